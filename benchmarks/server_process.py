"""Start `speccompile serve` in a child process and wait until it answers (a harness of the tests and the load benchmark)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerProcess:
    """A `speccompile serve ARTIFACT --port 0 --json ...` child on loopback; `url` is its /v1 base URL."""

    def __init__(self, artifact: str | Path, *args: str, startup_timeout: float = 180.0, env: dict[str, str] | None = None):
        command = [sys.executable, "-m", "speccompile.cli", "serve", str(artifact), "--json", *args]
        if "--port" not in args:
            command += ["--port", "0"]
        self.logs: list[str] = []
        self._port: int | None = None
        self._ready = threading.Event()
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})})
        self._reader = threading.Thread(target=self._read_logs, daemon=True)
        self._reader.start()
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base(self) -> str:
        """http://127.0.0.1:PORT"""
        return f"http://127.0.0.1:{self._port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL (…/v1)."""
        return self.base + "/v1"

    def _read_logs(self) -> None:
        for line in self.process.stderr:
            self.logs.append(line.rstrip("\n"))
            if self._port is None:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(entry, dict) and entry.get("message", "").startswith("serving") and "port" in entry:
                    self._port = int(entry["port"])
                    self._ready.set()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.2):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("speccompile serve did not start:\n" + "\n".join(self.logs[-30:]))
        while True:
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("speccompile serve never became healthy:\n" + "\n".join(self.logs[-30:]))
            time.sleep(0.2)

    def rss_bytes(self) -> int:
        """The server's resident memory (Linux /proc)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc")

    def cpu_seconds(self) -> float:
        """The server's user + system CPU time so far (Linux /proc; every thread, ONNX Runtime's spinning included)."""
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120.0) -> int:
        """Send `sig` and wait; the exit status (the child is killed if it outlives `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        return self.process.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
