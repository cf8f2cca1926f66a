"""llama-server's web UI in headless Chromium (Debian's chromium and chromium-driver, driven by Selenium):
open it, send one message, wait for the reply. Used by test_llama_server.py; by hand it also takes the
screenshot in docs/:

    .venv/bin/python tests/ui_check.py http://127.0.0.1:8080 docs/llama-server-ui.png
"""
from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
TIMEOUT_S = 60


def chat_in_the_web_ui(url: str, message: str, screenshot: Path) -> str:
    """The page's text once the model's reply to `message` is shown whole (its token count and speed
    under it); saves a screenshot of the page then."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), \
        "chromium and chromium-driver are not installed (bash tools/setup.sh --dev installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,760"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.set_page_load_timeout(TIMEOUT_S)
        driver.get(url + "/")
        deadline = time.monotonic() + TIMEOUT_S
        while not driver.find_elements(By.TAG_NAME, "textarea"):
            assert time.monotonic() < deadline, "the web UI showed no message box:\n" + driver.page_source[:2000]
            time.sleep(0.2)
        box = driver.find_element(By.TAG_NAME, "textarea")
        box.send_keys(message)
        box.send_keys(Keys.ENTER)
        # a finished reply shows its statistics ("16 tokens", "27.49 t/s") under it, and the Stop button
        # of a reply in progress is gone
        def finished(text: str) -> bool:
            return re.search(r"\d+ tokens\b.*\bt/s", text, re.S) is not None and "Stop" not in text.splitlines()

        while not finished(driver.find_element(By.TAG_NAME, "body").text):
            assert time.monotonic() < deadline, \
                "no reply within the time:\n" + driver.find_element(By.TAG_NAME, "body").text
            time.sleep(0.2)
        driver.save_screenshot(str(screenshot))
        return driver.find_element(By.TAG_NAME, "body").text
    finally:
        driver.quit()


if __name__ == "__main__":
    print(chat_in_the_web_ui(sys.argv[1], "Hello", Path(sys.argv[2])))
