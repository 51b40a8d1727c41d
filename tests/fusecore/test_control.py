"""The control socket's server (fusecore/process/control.py) over a real unix socket: a client that hangs up in the
middle of an answer (a warm agent that re-plans mid-warm) ends its own request, never the mount's serving."""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import stat
import time
import tracemalloc

import pytest
import trio

from fusecore.process import cli, control
from fusecore.config import ConfigError, MountConfig, StoreConfig
from fusecore.process.launch import LaunchFailed, launch, open_log


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


# --- issue 43: the control socket's bounds, and the state folder and log a mount's defaults use ---------------

def _serving(datapath, path, client):
    """Serve `datapath`'s control socket at `path` while `client` (blocking, in a thread) talks to it."""
    async def main():
        async with trio.open_nursery() as nursery:
            await nursery.start(control.serve, datapath, path)
            answer = await trio.to_thread.run_sync(client)
            nursery.cancel_scope.cancel()
        return answer

    return trio.run(main)


class Recorder:
    """A data path that records the numbers it was given (only what the control server calls)."""

    def __init__(self):
        self.calls = []

    def stats(self):
        return {"answered": True}

    def resize(self, cache_size):
        self.calls.append(("resize", cache_size))
        return {"budget": cache_size}

    async def set_peers(self, members, replicas=None):
        self.calls.append(("peers", len(members), replicas))
        return {"members": len(members)}

    async def join(self, request):
        self.calls.append(("join", len(request.members), request.replicas))
        return {"members": len(request.members)}


def _refusal(path, message):
    try:
        control.call(path, message, timeout=10)
    except control.ControlError as exc:
        return exc.kind, str(exc)
    raise AssertionError(f"{message!r:.80} was accepted")


def test_an_endless_request_line_is_refused_at_its_bound_and_the_socket_still_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "MAX_REQUEST", 1024 * 1024)
    path = str(tmp_path / "control.sock")
    endless = 64 * 1024 * 1024  # a line with no newline, as long as the client cares to send

    def client():
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)  # only so that a server that reads on forever fails the test rather than hangs it
            s.connect(path)
            sent, chunk = 0, b"x" * 65536
            try:
                while sent < endless:
                    s.sendall(chunk)
                    sent += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server stopped reading and hung up
            reply = json.loads(s.makefile("rb").readline())
        peak = tracemalloc.get_traced_memory()[1]  # the server's, mostly: the client sent one chunk again and again
        too_long = _refusal(path, {"op": "warm", "paths": ["x" * control.MAX_REQUEST]})  # the client's own path
        return sent, peak, reply, too_long, control.call(path, {"op": "stats"}, timeout=10)

    tracemalloc.start()
    try:
        sent, peak, reply, too_long, stats = _serving(Recorder(), path, client)
    finally:
        tracemalloc.stop()
    assert reply["kind"] == "too_large" and "longer than 1048576 bytes" in reply["error"]
    assert too_long[0] == "too_large"
    assert sent < control.MAX_REQUEST + 16 * 1024 * 1024  # cut off: the socket buffers' worth past the bound
    assert peak < 2 * control.MAX_REQUEST  # the mount held about one bound's worth, not what was sent
    assert stats == {"answered": True}  # a new connection is answered as before


def test_numbers_in_requests_are_integers_within_bounds_and_a_large_member_list_fits(tmp_path):
    path = str(tmp_path / "control.sock")
    datapath = Recorder()
    members = [f"[fd00:1234:5678:9abc:def0:1234:{i:04x}:9abc]:7000" for i in range(5000)]  # ~250 KB
    join = {"op": "join", "name": "ab" * 8, "me": members[0], "members": members, "replicas": 2,
            "key": "00" * 16, "handoff": "/run/handoff.sock"}
    bad = [10**30, -1, 0, True, "1073741824", 1.5, None]

    def client():
        refused = {"resize": [_refusal(path, {"op": "resize", "cache_size": v}) for v in bad],
                   "peers": [_refusal(path, {"op": "peers", "members": members[:3], "replicas": v})
                             for v in bad if v is not None],  # None: unchanged
                   "join": [_refusal(path, dict(join, replicas=v)) for v in bad]}
        control.resize(path, 2**30, timeout=10)
        control.set_peers(path, members, 3, timeout=10)
        control.call(path, join, timeout=10)
        return refused

    refused = _serving(datapath, path, client)
    for op, name in (("resize", "cache_size"), ("peers", "replicas"), ("join", "replicas")):
        for kind, message in refused[op]:
            assert kind == "bad_request" and f"{op}: {name} must be an integer from 1 to " in message, message
    assert "10000000000" in refused["resize"][0][1]  # says what it got (cut short)
    assert datapath.calls == [("resize", 2**30), ("peers", 5000, 3), ("join", 5000, 2)]  # only these went through


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    """Where runtime_dir() puts this user's state folder, inside tmp_path (root's and others' alike)."""
    monkeypatch.setattr(control, "ROOT_RUNTIME_DIR", str(tmp_path / "run-stoker"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return control.ROOT_RUNTIME_DIR if os.geteuid() == 0 else str(tmp_path / f"stoker-{os.getuid()}")


def _refused(problem):
    with pytest.raises(control.UnsafeRuntimeDir, match=problem) as caught:
        control.default_control_socket("/mnt/data")
    assert isinstance(caught.value, control.ControlError) and isinstance(caught.value, ConfigError)


def test_the_state_folder_is_made_private_and_one_not_this_user_s_own_is_refused(state_dir, tmp_path):
    assert os.path.dirname(control.default_control_socket("/mnt/data")) == state_dir  # made where missing
    st = os.lstat(state_dir)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()

    os.chmod(state_dir, 0o770)
    _refused(r"may be written by its group or others \(mode 770\)")

    os.rmdir(state_dir)
    os.mkdir(tmp_path / "elsewhere", 0o700)
    os.symlink(tmp_path / "elsewhere", state_dir)
    _refused("is a symbolic link")


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a folder to another user (root only)")
def test_a_state_folder_another_user_made_first_is_refused(state_dir, tmp_path, monkeypatch):
    os.mkdir(state_dir, 0o700)
    os.chown(state_dir, 4242, 4242)
    _refused("belongs to uid 4242, not to this user")

    # a user's own /tmp/stoker-<uid> (here under $XDG_RUNTIME_DIR): theirs is used, another's is refused
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    theirs = str(tmp_path / "stoker-4242")
    os.mkdir(theirs, 0o700)
    os.chown(theirs, 4242, 4242)
    assert control.runtime_dir() == theirs
    os.chown(theirs, 4343, 4343)
    _refused("belongs to uid 4343, not to this user")


def test_the_cli_refuses_an_unsafe_state_folder_with_a_message(state_dir, tmp_path, capsys):
    os.mkdir(state_dir, 0o777)
    os.chmod(state_dir, 0o777)
    parser = argparse.ArgumentParser()
    cli.add_commands(parser.add_subparsers())
    for argv, status in ((["mount", "s3://bucket", str(tmp_path)], 2), (["stats", str(tmp_path)], 1)):
        args = parser.parse_args(argv)
        assert args.func(args) == status
        assert f"the state folder {state_dir} may be written by its group or others" in capsys.readouterr().err


def test_the_log_is_never_opened_through_a_symbolic_link(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("not the mount's\n")
    os.symlink(target, tmp_path / "mount.log")
    cfg = MountConfig(store=StoreConfig(bucket="b"), mountpoint=str(tmp_path))
    with pytest.raises(LaunchFailed, match="is a symbolic link: refused") as caught:
        launch(cfg, log_file=str(tmp_path / "mount.log"), ready_timeout=1)  # refused before any process starts
    assert caught.value.kind == "config"
    assert target.read_text() == "not the mount's\n"

    fd = open_log(str(tmp_path / "new.log"))  # where nothing is: made, private
    try:
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600 and fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    finally:
        os.close(fd)
