"""Start a local S3 server (moto in server mode) on a free loopback port, in a child process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

from fusecore.process.launch import stop_process


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """A moto server process; use as a context manager. `env` extras go to the server only."""

    def __init__(self, port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._env = env or {}
        self._proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "MotoServer":
        env = dict(os.environ, **self._env)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with status {self._proc.returncode}")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=1).close()
                return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto server did not start in time")

    def stop(self) -> None:
        stop_process(self._proc)

    def __enter__(self) -> "MotoServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
