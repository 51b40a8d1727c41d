"""The control socket's server (fusecore/control.py) over a real unix socket: a client that hangs up in the
middle of an answer (a warm agent that re-plans mid-warm) ends its own request, never the mount's serving."""

from __future__ import annotations

import json
import socket
import time

import trio

from fusecore import control


class SlowWarm:
    """A data path whose warm reports progress for a while (only what the control server calls)."""

    def __init__(self):
        self.reports = 0  # reports the warm tried to send

    async def warm(self, paths, report):
        async with trio.open_nursery() as nursery:  # like DataPath.warm: the reporter runs in a nursery
            async def reporter():
                while True:
                    await trio.sleep(0.02)
                    self.reports += 1
                    await report({"files_done": self.reports})

            nursery.start_soon(reporter)
            await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
        return {"done": True}

    def stats(self):
        return {"answered": True}


def test_a_warm_client_that_hangs_up_does_not_end_the_mount_s_control_socket(tmp_path):
    path = str(tmp_path / "control.sock")
    datapath = SlowWarm()

    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(control.serve, datapath, path)

            def client():
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(path)
                    s.sendall(b'{"op": "warm", "paths": []}\n')
                    assert json.loads(s.makefile().readline())["files_done"] == 1
                # hung up mid-warm: the reporter's next send fails
                time.sleep(1.2)  # the warm ends; the server must still answer
                return control.call(path, {"op": "stats"}, timeout=5)

            answer = await trio.to_thread.run_sync(client)
            nursery.cancel_scope.cancel()
        return answer

    assert trio.run(main) == {"answered": True}
    assert datapath.reports >= 2  # one was sent after the hang-up
