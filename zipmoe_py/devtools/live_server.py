"""A live zipmoe-server on 127.0.0.1 (the one installed beside this Python), ready once made: for the test
suite and bench/server_load_bench.py. Needs the test extra (openai)."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from .ports import free_port

SERVER = Path(sys.executable).with_name("zipmoe-server")




class Server:
    """A live zipmoe-server, ready once made: load_s is how long that took."""

    def __init__(self, *args: str, port: int | None = None, ready_timeout: float = 120):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(SERVER), "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._log: list[str] = []
        threading.Thread(target=lambda: self._log.extend(self.proc.stdout), daemon=True).start()
        start = time.monotonic()
        while time.monotonic() < start + ready_timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"zipmoe-server exited with {self.proc.returncode}:\n{self.log}")
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2).read()
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.3)
        else:
            raise AssertionError(f"zipmoe-server did not answer within {ready_timeout:.0f} s:\n{self.log}")
        self.load_s = time.monotonic() - start
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    @property
    def log(self) -> str:
        return "".join(self._log)

    def get(self, route: str) -> dict:
        return json.loads(urllib.request.urlopen(self.url + route, timeout=30).read())

    def post(self, route: str, body: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + route, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")

    def chat(self, prompt: str, max_tokens: int = 12) -> str:
        r = self.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0)
        return r.choices[0].message.content

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
