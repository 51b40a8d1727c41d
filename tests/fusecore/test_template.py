"""The workers' template (process/template.py) in a process of its own: a fork needs a process with no thread, which
pytest's is not. What a mount does with it is tested through real mounts (test_workers.py); here, what only happens
when the template fails while the hub starts its workers: it died, or it stopped answering."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from fusecore.process import template as t

    t.ANSWER_TIMEOUT = 0.5  # (a stuck template's start fails after this)

    def serve(message, fds):
        os.write(fds[0], (str(message["n"]) + " " + str(os.getppid())).encode())
        return 7

    def forked():
        tpl = t.Template.fork(serve)
        assert tpl is not None, "no template: this process has threads"
        return tpl

    def start(tpl, n):
        r, w = os.pipe()
        try:
            pid = tpl.start({"n": n}, [w])
        finally:
            os.close(w)
        worker = t.Forked(pid)
        assert worker.wait() == 7, worker.returncode  # the hub's own child: it reaps the worker and reads its status
        said = os.read(r, 100).decode().split()
        assert said == [str(n), str(os.getpid())], said
        return pid

    def gone(tpl):
        try:
            start(tpl, 0)
        except t.TemplateGone as exc:
            return str(exc)
        raise AssertionError("a start on a failed template did not fail")

    killed = forked()
    start(killed, 1)
    os.kill(killed.pid, signal.SIGKILL)
    os.waitpid(killed.pid, 0)
    print("killed:", gone(killed))
    killed.close(grace=0)

    stuck = forked()
    start(stuck, 2)
    os.kill(stuck.pid, signal.SIGSTOP)
    began = time.monotonic()
    print("stuck:", gone(stuck))
    assert time.monotonic() - began < 30  # (the timeout, with a margin for a busy machine)
    stuck.close(grace=0)  # killed and reaped
    try:
        os.kill(stuck.pid, 0)
    except ProcessLookupError:
        print("reaped")

    # a process this one adopted (its parent died first), and a child of its own that it waits for itself
    told, tell = os.pipe()  # the orphan's pid, from its parent
    go, release = os.pipe()  # the orphan's end, from this process
    middle = os.fork()
    if middle == 0:
        orphan = os.fork()
        if orphan == 0:
            os.read(go, 1)  # (ends once its parent is gone and it was adopted)
            os._exit(0)
        os.write(tell, str(orphan).encode().ljust(16))
        os._exit(0)
    os.waitpid(middle, 0)
    orphan = int(os.read(told, 16))
    os.write(release, b"x")  # the orphan ends: a zombie of this process's, which nothing here waits for
    mine = os.fork()
    if mine == 0:
        os._exit(5)
    deadline = time.monotonic() + 30
    while not (t._zombie(orphan) and t._zombie(mine)) and time.monotonic() < deadline:
        time.sleep(0.01)  # (both ended, neither waited for)
    strays = t.Strays()
    strays.reap({mine})  # seen once: left (a library's child may be about to be waited for)
    assert os.path.exists(f"/proc/{orphan}")
    strays.reap({mine})
    assert not os.path.exists(f"/proc/{orphan}"), "the adopted zombie is reaped"
    assert os.waitpid(mine, 0)[1] >> 8 == 5, "a tracked child is left to its own wait"
    print("strays", strays.reaped)
""")


def test_a_template_that_died_or_stopped_answering_fails_the_start_and_is_reaped_as_are_adopted_zombies():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("killed: the workers' template"), lines
    assert lines[1].startswith("stuck: the workers' template is gone"), lines
    assert lines[2] == "reaped", lines
    assert lines[3] == "strays 1", lines
