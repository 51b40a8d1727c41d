"""The FUSE passthrough prototype (bench/stoker_bench/passthrough.py): a real mount of a local folder whose files the
kernel reads itself (Linux 6.9+); every byte checked, and not one READ reached the server."""

import os
import signal
import subprocess
import sys
import time

import pytest

from stoker_bench.objectstore import expected_bytes
from stoker_bench.passthrough import make_files
from tests.conftest import requires_fuse

pytestmark = [pytest.mark.integration, requires_fuse,
              pytest.mark.skipif(os.geteuid() != 0, reason="the prototype mounts with mount(2): root only")]

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")


@pytest.mark.parametrize("passthrough", [False, True])
def test_a_mounted_folder_reads_right_and_with_passthrough_no_read_reaches_the_server(tmp_path, passthrough):
    folder, mountpoint, ready = tmp_path / "disk", tmp_path / "mnt", tmp_path / "ready"
    mountpoint.mkdir()
    files = make_files(str(folder), 30)
    proc = subprocess.Popen([sys.executable, "-m", "stoker_bench.passthrough", "serve", "--folder", str(folder),
                             "--mountpoint", str(mountpoint), "--threads", "2", "--ready-file", str(ready),
                             *(["--passthrough"] if passthrough else [])],
                            env=dict(os.environ, PYTHONPATH=BENCH), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not ready.exists():
            if proc.poll() is not None:
                err = proc.stderr.read()
                if "does not offer passthrough" in err:
                    pytest.skip("this kernel has no FUSE passthrough (Linux 6.9+, CONFIG_FUSE_PASSTHROUGH)")
                raise AssertionError(f"the prototype did not mount: {err}")
            assert time.monotonic() < deadline, "the prototype did not mount"
            time.sleep(0.05)
        for key, size in files:
            with open(mountpoint / key, "rb", buffering=0) as f:
                assert f.read() == expected_bytes(key, 0, size), key
        os.kill(int(ready.read_text()), signal.SIGUSR1)
        reads = tmp_path / "ready.reads"
        while not reads.exists() or not reads.read_text():
            assert time.monotonic() < deadline + 10, "no count of READs"
            time.sleep(0.02)
        assert (int(reads.read_text()) == 0) == passthrough, reads.read_text()
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)
        proc.wait(timeout=30)
