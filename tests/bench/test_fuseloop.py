"""The multi-process prototype (bench/stoker_bench/fuseloop.py): one real FUSE connection served by two processes
through a cloned /dev/fuse descriptor; every byte checked, and each process shown to answer alone."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from stoker_bench.fixture import StoreProcess
from stoker_bench.objectstore import expected_bytes
from tests.conftest import requires_fuse

pytestmark = [pytest.mark.integration, requires_fuse,
              pytest.mark.skipif(os.geteuid() != 0, reason="the prototype mounts with mount(2): root only")]

FILES = {f"d/{i % 4}/f-{i:03d}.bin": 50_000 + 997 * i for i in range(40)}


def read_all(mountpoint, keys, timeout=20.0) -> int:
    """Files read whole and checked; a read that hangs fails the test instead of hanging it."""
    wrong = []

    def go():
        for key in keys:
            with open(os.path.join(mountpoint, key), "rb", buffering=0) as f:
                data = b"".join(iter(lambda: f.read(64 * 1024), b""))
            wrong.append(data != expected_bytes(key, 0, FILES[key]))

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "reads hung"
    return sum(wrong) + (len(keys) - len(wrong))


def stop(pid: int) -> None:
    """SIGSTOP, and wait until every thread of the process has stopped (a thread still on its way out of read(2)
    could take one more request)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state in "tT" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def test_two_processes_serve_one_connection_and_each_answers_alone(tmp_path):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    ready = tmp_path / "ready"
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")
    with StoreProcess({"bench": FILES}, latency=0, bandwidth=0, workdir=str(tmp_path)) as store:
        proc = subprocess.Popen([sys.executable, "-m", "stoker_bench.fuseloop", "serve", "--endpoint", store.endpoint,
                                 "--bucket", "bench", "--mountpoint", str(mountpoint), "--processes", "2",
                                 "--threads", "2", "--ready-file", str(ready)], env=dict(os.environ, PYTHONPATH=bench))
        try:
            deadline = time.monotonic() + 20
            while not ready.exists():
                assert proc.poll() is None and time.monotonic() < deadline, "the prototype did not mount"
                time.sleep(0.05)
            main, worker = (int(x) for x in ready.read_text().split())
            keys = sorted(FILES)
            assert read_all(mountpoint, keys) == 0
            for stopped, half in ((main, keys[:20]), (worker, keys[20:])):
                stop(stopped)
                try:
                    assert read_all(mountpoint, half) == 0, "the other process answered every request"
                finally:
                    os.kill(stopped, signal.SIGCONT)
        finally:
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
            proc.wait(timeout=20)
