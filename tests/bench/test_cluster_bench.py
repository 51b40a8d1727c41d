"""`stoker bench --cluster N` at a tiny scale: two real mounts per mode on loopback addresses, a real
DistributedSampler run through both, every byte checked; the store's counts (not speed) are asserted."""

import json
import subprocess
import sys

import pytest

from stoker_bench.cluster import ClusterDataset, ClusterResult, EpochRow, targets
from tests.conftest import requires_fuse

pytestmark = pytest.mark.integration


def test_partitions_are_a_reshuffled_split_of_the_dataset_each_epoch():
    d = ClusterDataset.build(0.02)
    for epoch in (1, 2):
        parts = [d.partition(epoch, 3, rank) for rank in range(3)]
        assert all((offset, length) == (0, size) for p in parts for _, size, offset, length in p), "whole files"
        assert sorted(i[:2] for p in parts for i in p) == sorted(d.items), "each item once per epoch, on one node"
    assert d.partition(1, 3, 0) != d.partition(2, 3, 0), "set_epoch reshuffles"


def test_with_shard_quarters_each_node_reads_another_quarter_of_every_shard_each_epoch():
    d = ClusterDataset.build(0.02, quarters=True)
    shards = [(key, size) for key, size in d.items if size > 1024 * 1024]
    assert len(shards) == 4
    for epoch in (1, 2):
        parts = [d.partition(epoch, 4, rank) for rank in range(4)]
        small = sorted(i[:2] for p in parts for i in p if i[1] <= 1024 * 1024)
        assert small == sorted(i for i in d.items if i[1] <= 1024 * 1024), "each small file once, on one node"
        for key, size in shards:  # the four nodes read its four quarters, one each
            quarters = sorted((offset, length) for p in parts for k, _, offset, length in p if k == key)
            assert quarters == [(q * size // 4, size // 4) for q in range(4)]
    assert {i[2] for i in d.partition(1, 4, 0) if i[1] > 1024 * 1024} != \
        {i[2] for i in d.partition(2, 4, 0) if i[1] > 1024 * 1024}, "another quarter each epoch"


def test_targets_name_each_figure_met_or_missed():
    result = ClusterResult(4, 1, 1000, 10, 500, [
        EpochRow("per-node", "2", store_bytes=700, files_per_s_per_node=100.0),
        EpochRow("distributed", "warm", store_bytes=1000), EpochRow("distributed", "1"),
        EpochRow("distributed", "2", store_gets=3, store_bytes=30, files_per_s_per_node=150.0),
        EpochRow("distributed", "kill", failed_reads=1)])
    text = "\n".join(targets(result))
    assert "MISSED: with the warm, epochs after the first sent 3 GETs" in text
    assert "met: with the warm, the store sent the dataset 1.030x" in text
    assert "MISSED: epoch 2 150.0 files/s per node against 100.0" in text
    assert "MISSED: a mount killed mid-epoch: 1 failed" in text


@requires_fuse
def test_a_two_node_run_reads_right_bytes_and_the_distributed_store_sends_the_dataset_once(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "stoker", "bench", "--cluster", "2", "--scale", "0.02",
                             "--epochs", "2", "--warm", "yes", "--peer-timeout", "10", "--out", str(out),
                             "--keep-page-reporting"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads((out / "cluster-2.json").read_text())
    assert [(r["mode"], r["epoch"]) for r in rows] == [
        ("per-node", "warm"), ("per-node", "1"), ("per-node", "2"),
        ("distributed", "warm"), ("distributed", "1"), ("distributed", "2"), ("distributed", "kill")]
    assert all(r["wrong"] == 0 for r in rows)
    assert all(r["failed_reads"] == 0 for r in rows), "a killed peer costs the others no read"
    distributed = {r["epoch"]: r for r in rows if r["mode"] == "distributed"}
    assert 0.99 <= distributed["warm"]["store_x_dataset"] <= 1.01, ("the warm fetched each block once, to its owner",
                                                                     rows)
    assert distributed["2"]["store_gets"] == 0 and distributed["2"]["peer_bytes"] > 0, rows
    assert "| distributed | kill |" in (out / "cluster-2.md").read_text()


def test_cold_targets_name_each_figure_met_or_missed():
    cold = "distributed, no warm"
    result = ClusterResult(4, 1, 1000, 10, 500, [
        EpochRow("per-node, no warm", "1", store_bytes=1000, files_per_s_per_node=100.0),
        EpochRow("per-node, no warm", "2", store_bytes=800, files_per_s_per_node=100.0),
        EpochRow(cold, "1", store_bytes=1040, files_per_s_per_node=95.0),
        EpochRow(cold, "2", store_gets=2, store_bytes=20, files_per_s_per_node=99.0),
        EpochRow(cold, "stop", longest_read_s=2.5), EpochRow(cold, "after stop", served_by_victim=3)])
    text = "\n".join(targets(result))
    assert "MISSED: without a warm, the store sent the dataset 1.060x over epochs 1-2" in text
    assert "MISSED: without a warm, epochs after the first sent 2 GETs, 0.0200x" in text
    assert "met: without a warm, epoch 1 95.0 files/s per node against 100.0" in text
    assert "MISSED: without a warm, epoch 2 99.0 files/s" in text
    assert "MISSED: a mount stopped 8 s mid-epoch: 0 failed and 0 wrong reads on the other nodes, their longest " \
           "file read 2.5 s" in text
    assert "met: after it continued, the stopped node served 3 blocks" in text


@pytest.mark.parametrize("args", [["--cluster", "1"], ["--cluster", "33"], ["--cluster", "2", "--epochs", "1"],
                                  ["--cluster", "2", "--replicas", "3"]])
def test_bad_cluster_arguments_are_refused_with_a_reason(args, tmp_path):
    result = subprocess.run([sys.executable, "-m", "stoker", "bench", *args, "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--cluster takes 2-32 nodes" in result.stderr, result.stderr
    assert not list(tmp_path.iterdir()), "nothing was run"
