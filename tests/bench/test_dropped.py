"""The page-cache-dropped measure (bench/stoker_bench/dropped.py): real mounts with a disk tier, warmed, read after
the page cache is dropped, every byte checked; with passthrough the kernel read every held file itself."""

import os

import pytest

from stoker_bench.dropped import measure
from tests.conftest import requires_fuse

pytestmark = [pytest.mark.integration, requires_fuse,
              pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")]


@pytest.mark.parametrize("workers", [1, 2])
def test_held_files_read_after_the_page_cache_is_dropped_are_right_and_passed_through(tmp_path, workers):
    lines: list[str] = []
    results = measure(120, 1, str(tmp_path), log=lines.append, workers=workers)
    (row,) = results["passes"]
    assert {"folder", "passthrough", "no-passthrough"} <= set(row), row
    assert all(row[label]["wrong"] == 0 and row[label]["files_s"] > 0 for label in row), row
    assert row["passthrough"]["cpu_ms_per_file"] > 0 and row["folder"]["cpu_ms_per_file"] == 0
    if results["passthrough_opens"] == 0:
        pytest.skip("this kernel or machine gives the mount no passthrough (Linux 6.9+ and CAP_SYS_ADMIN)")
    assert results["passthrough_opens"] >= 120 and results["no-passthrough_opens"] == 0, results
    assert "of the folder" in lines[0]
