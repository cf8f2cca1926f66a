"""A live llama-server of the fork on 127.0.0.1, for the tests and bench/llama_server_bench.py.

`LlamaServer(model, *args, env={...})` starts the installed `llama-server` (the one beside the Python
running this) with the given flags and ZIPMOE_* environment, and returns once /health answers 200.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from zipmoe_py.devtools.ports import free_port

LLAMA_SERVER = Path(sys.executable).with_name("llama-server")




class LlamaServer:
    """A running llama-server; `stop()` (or `with`) ends it. `log` is what it printed."""

    def __init__(self, model: Path, *args: str, env: dict | None = None, ready_timeout: float = 120,
                 prefix: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        program = str(LLAMA_SERVER) if LLAMA_SERVER.exists() else shutil.which("llama-server")
        assert program, "llama-server is not installed (run bash tools/setup.sh)"
        self.cmd = [*(prefix or []), program, "-m", str(model), "--host", "127.0.0.1",
                    "--port", str(self.port), *map(str, args)]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self._log: list[str] = []
        threading.Thread(target=lambda: self._log.extend(self.proc.stdout), daemon=True).start()
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited with {self.proc.returncode}:\n{self.log}")
            if time.monotonic() > start + ready_timeout:
                self.stop()
                raise AssertionError(f"llama-server did not answer within {ready_timeout:.0f} s:\n{self.log}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        self.load_s = time.monotonic() - start

    @property
    def log(self) -> str:
        return "".join(self._log)

    def post(self, path: str, body, timeout: float = 300) -> tuple[int, dict | list]:
        """(HTTP status, JSON reply) of a POST; body is JSON-encoded unless it is bytes."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return resp.read().decode()

    def metrics(self) -> dict[str, float]:
        """/metrics (the server needs --metrics) as {name: value}, labels kept in the name."""
        out = {}
        for line in self.get_text("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "LlamaServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
