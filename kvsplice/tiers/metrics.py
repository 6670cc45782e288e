"""Prometheus metrics of the store's tiers, read from `TieredStore.stats()` when /metrics is scraped.

Named like the server's own (`kvsplice:*`, label `model_name`), with a `tier` label ("disk",
"redis"). Mean load time per hit is rate(kvsplice:store_load_seconds) / rate(kvsplice:store_hits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsplice.tiers.tier import TierStats

# TierStats field -> (metric name, help). Bytes and writes count every entry: segments, and the trust
# gate's record of samples (engine/gate_sync.py); hits, misses and load times count segments only.
METRICS = {
    "hits": ("kvsplice:store_hits", "Segment lookups served by this tier"),
    "misses": ("kvsplice:store_misses", "Segment lookups this tier did not serve (corrupt entries too)"),
    "corrupt": ("kvsplice:store_corrupt_entries", "Entries that failed verification, deleted and not served"),
    "bytes_read": ("kvsplice:store_read_bytes", "Bytes read from this tier (segments, gate record)"),
    "bytes_written": ("kvsplice:store_written_bytes", "Bytes written to this tier (segments, gate record)"),
    "writes": ("kvsplice:store_writes", "Entries written to this tier (segments, gate record)"),
    "load_seconds": ("kvsplice:store_load_seconds", "Seconds spent reading, verifying and decoding hits"),
    "errors": ("kvsplice:store_errors", "Failed tier operations (I/O errors, timeouts, refused connections)"),
    "dropped_writes": ("kvsplice:store_dropped_writes", "Writes dropped: queue full or entry over budget"),
    "evictions": ("kvsplice:store_evictions", "Entries deleted to stay within the tier's byte budget"),
    "skipped": ("kvsplice:store_skipped_calls", "Calls not made because the tier's circuit was open"),
}


def register_store_metrics(
    registry: CollectorRegistry, model_name: str, stats: Callable[[], Mapping[str, TierStats]]
) -> None:
    """Expose the tiers' counters in `registry`; `stats` is called at each scrape (thread-safe)."""
    registry.register(_StoreCollector(model_name, stats))


class _StoreCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], Mapping[str, TierStats]]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        snapshot = self._stats()
        for field_name, (metric, doc) in METRICS.items():
            family = CounterMetricFamily(metric, doc, labels=["model_name", "tier"])
            for tier, stats in snapshot.items():
                family.add_metric([self._model_name, tier], getattr(stats, field_name))
            yield family
