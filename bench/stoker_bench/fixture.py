"""Runs the emulated object store in its own process and reads its request counters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

from fusecore.process.launch import stop_process


class StoreProcess:
    def __init__(self, objects: dict[str, dict[str, int]], *, latency: float, bandwidth: float, workdir: str):
        self.objects = objects
        self.latency = latency
        self.bandwidth = bandwidth
        self.workdir = workdir
        self.endpoint = ""
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> "StoreProcess":
        dataset = os.path.join(self.workdir, "dataset.json")
        port_file = os.path.join(self.workdir, "store.port")
        with open(dataset, "w") as f:
            json.dump(self.objects, f)
        if os.path.exists(port_file):
            os.unlink(port_file)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stoker_bench.objectstore", "--dataset", dataset, "--latency", str(self.latency),
             "--bandwidth", str(self.bandwidth), "--port-file", port_file],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(self.workdir, "store.log"), "w"))
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the emulated object store did not start")
            time.sleep(0.05)
        with open(port_file) as f:
            self.endpoint = f"http://127.0.0.1:{int(f.read())}"
        return self

    def stats(self) -> dict:
        with urllib.request.urlopen(self.endpoint + "/_stats", timeout=10) as r:
            return json.loads(r.read())

    def written(self) -> dict:
        """Objects clients wrote since the store started: {"bucket/key": {"size", "right"}}."""
        with urllib.request.urlopen(f"{self.endpoint}/_written", timeout=30) as resp:
            return json.load(resp)

    def reset(self) -> None:
        req = urllib.request.Request(self.endpoint + "/_reset", method="POST")
        urllib.request.urlopen(req, timeout=10).close()

    def stop(self) -> None:
        stop_process(self.proc)

    def __enter__(self) -> "StoreProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scratch_dir(prefix: str = "stoker-bench-") -> str:
    return tempfile.mkdtemp(prefix=prefix)


def wait_for(predicate, timeout: float, interval: float = 0.1):
    """Poll `predicate` until it returns something truthy (returned) or `timeout` passes (last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()
