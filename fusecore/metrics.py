"""Prometheus metrics of one mount (its own registry, served on --metrics-port)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def _field_of(stats: Callable, name: str) -> Callable[[], float]:
    return lambda: getattr(stats(), name)


class MountMetrics:
    """Counters the data path updates; cache gauges are read from the cache when scraped."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.bytes_served = Counter("stoker_bytes_served", "Bytes returned to readers, by source",
                                    ["source"], registry=r)
        self.get_requests = Counter("stoker_get_requests", "Range GET requests sent", ["kind"], registry=r)
        self.get_bytes = Counter("stoker_get_bytes", "Bytes received from range GETs", registry=r)
        self.store_bytes = Counter("stoker_store_bytes", "Bytes received from the store, by why they were fetched "
                                   "(demand, read-ahead, range, read-through, fallback)", ["cause"], registry=r)
        self.get_latency = Histogram("stoker_get_latency_seconds", "Range GET latency (whole body)",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.list_requests = Counter("stoker_list_requests", "LIST requests sent", registry=r)
        self.head_requests = Counter("stoker_head_requests", "HEAD requests sent", registry=r)
        self.inflight_requests = Gauge("stoker_inflight_requests", "GETs in flight", registry=r)
        self.inflight_bytes = Gauge("stoker_inflight_bytes", "Bytes of GETs in flight", registry=r)
        self.errors = Counter("stoker_errors", "Object-store errors by kind", ["kind"], registry=r)
        self.retries = Counter("stoker_body_retries", "GETs retried (a broken body, throttling, a 5xx, a wrong range)",
                               registry=r)
        self.throttled = Counter("stoker_throttled", "GET answers that were throttling (503 SlowDown, 429)",
                                 registry=r)
        # A distributed cache (cluster/tier.py): blocks asked of peers, per peer (a counter per member: mean latency
        # is seconds over requests; one histogram for all, so series do not grow with members x buckets).
        self.peer_requests = Counter("stoker_peer_requests", "Blocks asked of a peer, by outcome (hit, miss, failed)",
                                     ["peer", "outcome"], registry=r)
        self.peer_bytes = Counter("stoker_peer_bytes", "Bytes received from a peer", ["peer"], registry=r)
        self.peer_seconds = Counter("stoker_peer_seconds", "Seconds spent asking a peer", ["peer"], registry=r)
        self.peer_latency = Histogram("stoker_peer_latency_seconds", "Time to a peer's whole answer (any peer)",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.peer_served_bytes = Counter("stoker_peer_served_bytes", "Bytes this node served to its peers",
                                         registry=r)
        self.peer_read_through = Counter("stoker_peer_read_through", "Block reads this node, as their owner, "
                                         "fetched from the store for a peer (served, or failed: the peer read the "
                                         "store itself)", ["outcome"], registry=r)
        self.cluster_members = Gauge("stoker_cluster_members", "Members of the distributed cache", registry=r)
        self.cluster_share = Gauge("stoker_cluster_owned_share",
                                   "Share of the blocks this node owns (about replicas / members)", registry=r)
        self.cache_bytes = Gauge("stoker_cache_bytes", "Bytes held by the block cache", registry=r)
        self.cache_budget = Gauge("stoker_cache_budget_bytes", "Configured cache budget", registry=r)
        self.cache_evictions = Gauge("stoker_cache_evictions", "Blocks evicted or not admitted (total)",
                                     registry=r)
        self.cache_hit_ratio = Gauge("stoker_cache_hit_ratio", "Block lookups served from the cache",
                                     registry=r)

    def bind_cache(self, stats: Callable) -> None:
        """Make the cache gauges read live values from `stats()` at scrape time."""
        self.cache_bytes.set_function(lambda: stats().bytes)
        self.cache_budget.set_function(lambda: stats().budget)
        self.cache_evictions.set_function(lambda: stats().evictions)
        self.cache_hit_ratio.set_function(lambda: stats().hit_ratio)

    def bind_disk(self, stats: Callable) -> None:
        disk_gauges(self.registry, stats)

    def bind_writes(self, stats: Callable[[], dict | None]) -> None:
        write_gauges(self.registry, stats)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def text(self) -> str:
        """The exposition of this process's metrics (a worker's, for its hub: `Summed`)."""
        return generate_latest(self.registry).decode()

    def value(self, metric: Counter | Gauge, **labels: str) -> float:
        """The current value of a counter or gauge (through the registry's public sample lookup)."""
        family = next(iter(metric.describe()))
        sample = family.name + ("_total" if family.type == "counter" else "")
        return self.registry.get_sample_value(sample, labels) or 0.0


DISK_EVENTS = ("hits", "misses", "written", "skipped", "dropped", "evicted", "errors")


def disk_gauges(r: CollectorRegistry, stats: Callable) -> None:
    """Gauges of the disk tier (fusecore/cache/disk.py), read from `stats()` at scrape time (a mount's own process;
    the hub of several workers and each worker its part: their sum is the mount's)."""
    Gauge("stoker_disk_bytes", "Bytes held by the disk tier", registry=r).set_function(_field_of(stats, "bytes"))
    Gauge("stoker_disk_budget_bytes", "Configured disk tier budget", registry=r).set_function(
        _field_of(stats, "budget"))
    Gauge("stoker_disk_read_bytes", "Bytes read back from the disk tier (total)", registry=r).set_function(
        _field_of(stats, "bytes_read"))
    Gauge("stoker_disk_paused", "1 while the disk tier does not write (free space under its floor, a failed "
          "write)", registry=r).set_function(lambda: 1 if stats().paused else 0)
    blocks = Gauge("stoker_disk_blocks", "Blocks of the disk tier by event (total): hits, misses, written, "
                   "skipped (not written), dropped (failed their check), evicted, errors", ["event"], registry=r)
    for event in DISK_EVENTS:
        blocks.labels(event=event).set_function(_field_of(stats, event))


# ratios, and what each worker of a mount says alike (its members): the workers' mean
AVERAGED = frozenset({"stoker_cache_hit_ratio", "stoker_cluster_owned_share", "stoker_cluster_members"})


class Summed:
    """A collector of the metrics of a mount's workers, as one mount's: each sample summed over the workers (their
    ratios averaged). `texts()` gives each worker's exposition (asked over its control socket at scrape time)."""

    def __init__(self, texts: Callable[[], list[str]]):
        self._texts = texts

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple, list[float]]] = {}
        for text in self._texts():
            for family in text_string_to_metric_families(text):
                if family.name not in families:
                    families[family.name] = Metric(family.name, family.documentation, family.type)
                    values[family.name] = {}
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    values[family.name].setdefault(key, []).append(sample.value)
        for name, family in families.items():
            for (sample, labels), seen in values[name].items():
                value = sum(seen) / len(seen) if name in AVERAGED else sum(seen)
                family.add_sample(sample, dict(labels), value)
        return list(families.values())


WRITE_GAUGES = (  # (name, help, field of a writable mount's `writes` stats: DataPath.write_stats)
    ("stoker_bytes_written", "Bytes written through the mount (total)", "bytes_written"),
    ("stoker_uploads_completed", "Objects written: uploads completed (total)", "uploads_completed"),
    ("stoker_uploads_aborted", "Uploads aborted: files that failed and left no object (total)", "uploads_aborted"),
    ("stoker_parts_sent", "Parts of multipart uploads sent (total)", "parts_sent"),
    ("stoker_upload_requests_retried", "Upload requests sent again by botocore's retries (total)",
     "requests_retried"),
    ("stoker_files_being_written", "Files open for writing now", "files_open"),
    ("stoker_uploads_open", "Multipart uploads open now", "uploads_open"),
)


def write_gauges(registry: CollectorRegistry, stats: Callable[[], dict | None]) -> None:
    """A writable mount's gauges, read from `stats()` at scrape time (a mount's own process, or the hub of several
    workers: its writes are its own)."""
    def field(key: str) -> Callable[[], float]:
        return lambda: (stats() or {}).get(key, 0)

    for name, doc, key in WRITE_GAUGES:
        Gauge(name, doc, registry=registry).set_function(field(key))
