"""The bench pauses a VM's free page reporting for a run and puts it back (stoker_bench.hostmem)."""

from __future__ import annotations

import argparse

import pytest

from stoker_bench import cli, hostmem

MiB = 1 << 20


@pytest.fixture
def order(tmp_path):
    path = tmp_path / "page_reporting_order"
    path.write_text("9\n")
    return path


def test_reporting_is_paused_for_the_run_memory_touched_and_the_order_put_back(order):
    with hostmem.reporting_paused(path=str(order), prime_limit=24 * MiB) as memory:
        assert order.read_text() == hostmem.NEVER
        assert memory.reporting == "paused" and memory.order == "9"
        assert memory.primed_bytes == 24 * MiB
        assert "paused for the run and 0.0 GiB touched first" in memory.describe()
    assert order.read_text() == "9"


def test_a_kernel_whose_reporting_no_driver_registered_is_left_alone(order):
    """The parameter reads 4294967295 until a balloon driver registers: nothing is reported, so nothing is
    paused or primed, and the report says nothing (a bare-metal node with the feature built in)."""
    order.write_text("4294967295\n")
    with hostmem.reporting_paused(path=str(order), prime_limit=24 * MiB) as memory:
        assert order.read_text() == "4294967295\n"
    assert memory.reporting == "absent" and memory.primed_bytes == 0 and memory.describe() == ""


def test_the_order_is_put_back_when_the_run_fails(order):
    with pytest.raises(RuntimeError):
        with hostmem.reporting_paused(path=str(order), prime_limit=MiB):
            raise RuntimeError("a cell crashed")
    assert order.read_text() == "9"


def test_kept_on_request_and_the_report_says_what_it_costs(order):
    with hostmem.reporting_paused(keep=True, path=str(order), prime_limit=MiB) as memory:
        assert order.read_text() == "9\n" and memory.primed_bytes == 0
    assert memory.reporting == "kept" and "every fresh page costs a host fault" in memory.describe()


def test_a_run_inside_a_paused_run_leaves_it_to_its_parent(order):
    """The A/B's sides run inside the parent's pause: they neither prime again nor put back the parent's order."""
    order.write_text(hostmem.NEVER)
    with hostmem.reporting_paused(path=str(order), prime_limit=MiB) as memory:
        assert memory.reporting == "paused" and memory.primed_bytes == 0
    assert order.read_text() == hostmem.NEVER


def test_a_machine_without_reporting_says_nothing(tmp_path):
    with hostmem.reporting_paused(path=str(tmp_path / "absent"), prime_limit=MiB) as memory:
        assert memory.reporting == "absent" and memory.describe() == ""


def test_an_order_that_cannot_be_written_is_reported_not_fatal(order, monkeypatch):
    real_open = open

    def refuse_writes(path, mode="r", *args, **kwargs):
        if "w" in mode:
            raise PermissionError(13, "Permission denied")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(hostmem, "open", refuse_writes, raising=False)
    with hostmem.reporting_paused(path=str(order), prime_limit=MiB) as memory:
        assert memory.primed_bytes == 0
    assert memory.reporting == "cannot pause (Permission denied)"
    assert "every fresh page costs a host fault" in memory.describe()


def test_prime_touches_the_size_asked_in_chunks():
    assert hostmem.prime(0) == 0
    assert hostmem.prime(hostmem._CHUNK + 3 * MiB) == hostmem._CHUNK + 3 * MiB


def test_a_refused_run_is_refused_before_memory_is_touched(monkeypatch, capsys):
    """Priming takes ~25 s on a fresh VM: a typo in a workload must not wait for it."""
    def must_not_pause(**kwargs):
        raise AssertionError("paused before the arguments were checked")

    monkeypatch.setattr(hostmem, "reporting_paused", must_not_pause)
    parser = argparse.ArgumentParser()
    cli.add_command(parser.add_subparsers())
    args = parser.parse_args(["bench", "--workloads", "seq1,nope"])
    assert cli.run(args) == 2
    assert "unknown system or workload: nope" in capsys.readouterr().err
    args = parser.parse_args(["bench", "--compare", "HEAD", "--rounds", "1"])
    assert cli.run(args) == 2
