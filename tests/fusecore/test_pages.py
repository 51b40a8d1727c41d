"""Which pages a mount's block buffers come from, read from a /sys and /proc/buddyinfo laid out as the
kernel lays them out (transparent_hugepage/enabled brackets the mode; page_reporting_order reads
4294967295 until a balloon driver registers, pageblock_order (9) once one has; `stoker bench` writes
the largest order + 1 to pause it)."""

from __future__ import annotations

import re

import pytest

from fusecore.cache import pages
from fusecore.config import ConfigError, MountConfig, StoreConfig

BUDDY = ("Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3\n"
         "Node 0, zone    DMA32      2      2      3      2      3      2      1      4      4      2    752\n")


def machine(tmp_path, thp: str | None = "always [madvise] never", order: str | None = None) -> tuple[str, str]:
    """A /sys root and a buddyinfo file: `thp` the enabled file's text (None: no THP in this kernel),
    `order` page_reporting_order's (None: no page reporting built in)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "sys"
    if thp is not None:
        (root / "kernel/mm/transparent_hugepage").mkdir(parents=True)
        (root / pages.THP_ENABLED).write_text(thp + "\n")
    if order is not None:
        (root / "module/page_reporting/parameters").mkdir(parents=True)
        (root / pages.REPORTING_ORDER).write_text(order + "\n")
    buddy = tmp_path / "buddyinfo"
    buddy.write_text(BUDDY)
    return str(root), str(buddy)


def choose(tmp_path, setting: str, block_size: int = 4 * 1024 * 1024, **kw) -> pages.Pages:
    return pages.choose(setting, block_size, *machine(tmp_path, **kw))


@pytest.mark.parametrize("order", [None, "4294967295", "11"])
def test_auto_takes_huge_pages_where_no_free_memory_is_reported(tmp_path, order):
    """No reporting built in, no balloon registered, or reporting paused above the largest order."""
    chosen = choose(tmp_path, "auto", order=order)
    assert chosen.huge and chosen.size == "2 MiB" and "madvise" in chosen.why


@pytest.mark.parametrize("order", ["9", "10", "0"])
def test_auto_keeps_4k_pages_on_a_vm_that_reports_free_memory(tmp_path, order):
    chosen = choose(tmp_path, "auto", order=order)
    assert not chosen.huge and chosen.size == "4 KiB" and f"order {order}" in chosen.why


@pytest.mark.parametrize("thp", [None, "always madvise [never]"])
def test_no_huge_pages_where_the_kernel_offers_none_even_when_asked(tmp_path, thp):
    for setting in ("auto", "on"):
        chosen = choose(tmp_path / setting, setting, thp=thp)
        assert not chosen.huge and "no transparent huge pages" in chosen.why


def test_on_and_off_decide_regardless_of_the_reporting(tmp_path):
    assert choose(tmp_path, "on", order="9") == pages.Pages(True, "--huge-pages on")
    assert choose(tmp_path / "b", "off", order=None) == pages.Pages(False, "--huge-pages off")


@pytest.mark.parametrize("setting", ["auto", "on"])
def test_blocks_smaller_than_a_huge_page_stay_on_4k_pages(tmp_path, setting):
    chosen = choose(tmp_path, setting, block_size=1024 * 1024)
    assert not chosen.huge and "blocks of 1024 KiB are smaller than a 2 MiB page" in chosen.why
    assert choose(tmp_path / "two", setting, block_size=2 * 1024 * 1024).huge


def test_the_largest_order_is_read_from_buddyinfo(tmp_path):
    _, buddy = machine(tmp_path)
    assert pages.largest_order(buddy) == 10
    short = tmp_path / "short"
    short.write_text("Node 0, zone   Normal  1 2 3 4 5 6 7 8 9\n")  # a kernel whose largest order is 8
    assert pages.largest_order(str(short)) == 8
    root, _ = machine(tmp_path / "m", order="9")
    assert pages.reporting_order(root, str(short)) is None  # 9 is above this kernel's orders: paused
    assert pages.largest_order(str(tmp_path / "absent")) == pages.DEFAULT_MAX_ORDER


def _text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def test_this_machine_reads_without_error():
    """The choice for this machine's own files, against what the test reads of them itself (by the kernel's
    formats, not through pages' readers): THP offered where enabled brackets always or madvise; free page
    reporting active where page_reporting_order is a number at most the largest order, which is the count
    of /proc/buddyinfo's columns after "Node N, zone NAME", less one (orders start at 0)."""
    enabled = _text("/sys/kernel/mm/transparent_hugepage/enabled")
    offered = enabled is not None and re.search(r"\[(always|madvise)\]", enabled) is not None
    with open("/proc/buddyinfo") as f:
        first = f.readline()
    columns = re.fullmatch(r"Node\s+\d+,\s+zone\s+\S+((?:\s+\d+)+)\s*", first)
    assert columns is not None, first
    largest = len(columns.group(1).split()) - 1
    reported = _text("/sys/module/page_reporting/parameters/page_reporting_order")
    reporting = reported is not None and re.fullmatch(r"\s*\d+\s*", reported) is not None \
        and int(reported) <= largest
    chosen = pages.choose("auto", 4 * 1024 * 1024)
    assert chosen.huge == (offered and not reporting), (enabled, reported, largest, chosen.why)
    assert pages.largest_order() == largest >= 9


def test_a_setting_other_than_auto_on_off_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"huge-pages: must be one of auto, on, off \(got 'yes'\)"):
        MountConfig(store=StoreConfig(bucket="b"), huge_pages="yes")
