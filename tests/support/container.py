"""A "container" for tests: a process in its own mount namespace that sees pod volumes the way runc
shows them with mountPropagation HostToContainer (an rslave recursive bind of each target, made when
the container starts), and reads files there on request.

Run as a module inside `unshare --mount --propagation unchanged`; it answers one JSON line per request.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading


class Container:
    """The test side: start it, ask it to read, stop it."""

    def __init__(self, volumes: dict[str, str]):
        self.views = {name: tempfile.mkdtemp(prefix=f"ctr-{name}-") for name in volumes}
        spec = json.dumps({self.views[name]: target for name, target in volumes.items()})
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "unchanged", sys.executable, "-m",
                                      "tests.support.container", spec], cwd=repo, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"container did not start: {ready!r}")

    def read(self, volume: str, path: str, timeout: float = 60.0) -> str:
        """sha256 hex of the file as the container reads it, or 'errno N' (never hangs past `timeout`)."""
        with self._lock:
            self.proc.stdin.write(json.dumps([os.path.join(self.views[volume], path), timeout]) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline() or '"container exited"')

    def write(self, volume: str, path: str, data: bytes, timeout: float = 60.0) -> str:
        """Write a file as the container would (created, written, closed): 'ok' or 'errno N'."""
        with self._lock:
            self.proc.stdin.write(json.dumps([os.path.join(self.views[volume], path), timeout,
                                              base64.b64encode(data).decode()]) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline() or '"container exited"')

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for view in self.views.values():
            try:
                os.rmdir(view)
            except OSError:
                pass


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        return f"errno {exc.errno}"


def _write(path: str, data: bytes) -> str:
    try:
        with open(path, "wb") as f:
            f.write(data)
        return "ok"
    except OSError as exc:
        return f"errno {exc.errno}"


def _main(spec: str) -> None:
    subprocess.run(["mount", "--make-rslave", "/"], check=True)  # runc's default root propagation
    for view, target in json.loads(spec).items():
        subprocess.run(["mount", "--rbind", target, view], check=True)
        subprocess.run(["mount", "--make-rslave", view], check=True)  # HostToContainer
    print("ready", flush=True)
    for line in sys.stdin:
        path, timeout, *written = json.loads(line)
        result: list[str] = [f"still at it after {timeout}s"]
        work = (lambda: _write(path, base64.b64decode(written[0]))) if written else (lambda: _read(path))
        reader = threading.Thread(target=lambda: result.__setitem__(0, work()), daemon=True)
        reader.start()
        reader.join(timeout)
        print(json.dumps(result[0]), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1])
