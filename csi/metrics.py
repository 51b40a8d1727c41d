"""Prometheus metrics of every Stoker mount on the node, served by the node plugin.

Each mount keeps its own counters; at scrape time this collector asks each volume's mount over its
control socket, so one endpoint per node (the chart's metrics Service) covers all volumes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fusecore.process import control

from .volumes import VolumeManager


class VolumesCollector:
    def __init__(self, volumes: VolumeManager):
        self.volumes = volumes

    def collect(self):
        up = GaugeMetricFamily("stoker_volume_up", "1 while the volume's mount answers", labels=["volume"])
        budget = GaugeMetricFamily("stoker_volume_cache_budget_bytes", "cache budget", labels=["volume"])
        cached = GaugeMetricFamily("stoker_volume_cache_bytes", "bytes in the cache", labels=["volume"])
        hit = GaugeMetricFamily("stoker_volume_cache_hit_ratio", "block cache hit ratio", labels=["volume"])
        fetched = CounterMetricFamily("stoker_volume_fetched_bytes", "bytes fetched from the store", labels=["volume"])
        served = CounterMetricFamily("stoker_volume_served_bytes", "bytes served to readers", labels=["volume", "source"])
        gets = CounterMetricFamily("stoker_volume_get_requests", "GET requests sent", labels=["volume"])
        inflight = GaugeMetricFamily("stoker_volume_inflight_bytes", "bytes of GETs in flight", labels=["volume"])
        for record in self.volumes.state.records():
            volume = record.volume_id
            try:
                stats = control.stats(self.volumes.state.control_socket(volume), timeout=2)
            except (control.ControlError, OSError, ValueError):
                up.add_metric([volume], 0)
                continue
            up.add_metric([volume], 1)
            budget.add_metric([volume], stats.cache.budget)
            cached.add_metric([volume], stats.cache.bytes)
            hit.add_metric([volume], stats.cache.hit_ratio)
            fetched.add_metric([volume], stats.bytes_fetched)
            served.add_metric([volume, "cache"], stats.served_from_cache)
            served.add_metric([volume, "network"], stats.served_from_network)
            gets.add_metric([volume], stats.get_requests)
            inflight.add_metric([volume], stats.inflight_bytes)
        yield from (up, budget, cached, hit, fetched, served, gets, inflight)
        node = GaugeMetricFamily("stoker_node_cache_budget_bytes", "cache budgets of every volume on the node together")
        node.add_metric([], sum(self.volumes.node_cache_usage().values()))
        yield node
        if self.volumes.node_cache_memory is not None:
            limit = GaugeMetricFamily("stoker_node_cache_memory_bytes", "the node's cache memory (node.cacheMemory)")
            limit.add_metric([], self.volumes.node_cache_memory)
            yield limit


def serve_metrics(volumes: VolumeManager, port: int, addr: str = "0.0.0.0") -> None:
    registry = CollectorRegistry()
    registry.register(VolumesCollector(volumes))
    start_http_server(port, addr=addr, registry=registry)
