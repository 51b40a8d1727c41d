"""A mount's control socket without a mount (stats, warm, resize, credentials), answering the shapes
fusecore.messages reads: for the operator scale benchmark's real agents and the CSI lifecycle tests'
fake kernel, where the mount is not what is measured or tested."""

from __future__ import annotations

import json
import os
import socket
import threading

from fusecore.messages import WarmProgress


class FakeMountControl:
    def __init__(self, path: str, budget: int, *, warm_bytes: int = 0, warm_files: int = 0):
        self.path, self.budget = path, budget
        self.warm_bytes, self.warm_files = warm_bytes, warm_files  # what a warm reports it loaded
        self.cached = 0
        self.rotations = 0
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(64)
        self.alive = True
        threading.Thread(target=self._serve, daemon=True).start()

    def stats(self) -> dict:
        """A `stats` reply of the shape fusecore.messages.MountStats reads (what a real mount sends, trimmed)."""
        return {"pid": os.getpid(), "cache": {"bytes": self.cached, "budget": self.budget, "entries": 0, "hits": 0,
                                              "misses": 0, "hit_ratio": 0.0},
                "requests": {"get": 0}, "bytes_fetched": 0, "bytes_served": {"cache": 0, "network": 0},
                "inflight": {"requests": 0, "bytes": 0}}

    def kill(self) -> None:
        """The process died: nothing answers any more."""
        self.alive = False
        self.sock.close()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            request = json.loads(f.readline())
            for reply in self._replies(request):
                f.write(json.dumps(reply).encode() + b"\n")
            f.flush()

    def _replies(self, request: dict) -> list[dict]:
        op = request.get("op")
        if op == "warm":
            half = WarmProgress(self.warm_files, self.warm_bytes, self.warm_files // 2, self.warm_bytes // 2)
            self.cached = max(self.cached, self.warm_bytes)
            done = WarmProgress(self.warm_files, self.warm_bytes, self.warm_files, self.warm_bytes, seconds=0.1,
                                done=True)
            return [half.wire(), done.wire()]
        if op == "resize":
            self.budget = int(request["cache_size"])
        elif op == "credentials":
            self.rotations += 1
        elif op != "stats":
            return [{"error": f"unknown op {op!r}", "kind": "unknown_op"}]
        return [self.stats()]
