"""The TieredStore's order and write-through, the circuit breaker's states, and the metrics: a slow
tier never delays a caller, writes beyond a tier's queue are dropped and counted."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvsplice.tiers import DiskTier, Tier, TieredStore, register_store_metrics
from kvsplice.tiers.breaker import CircuitBreaker
from tests.test_store_support import fingerprint, segment

FP = fingerprint()


class SlowTier(Tier):
    """A tier whose writes wait until released (a saturated disk, a server at its limit)."""

    name = "slow"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.data: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self.data.get(key)

    def put(self, key: str, data: bytes | bytearray) -> bool:
        self.release.wait()
        self.data[key] = bytes(data)
        self.counters.add(writes=1)
        return True

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def close(self) -> None:
        self.release.set()


def test_a_slow_tier_never_delays_the_caller_and_overflow_is_dropped_and_counted(tmp_path: Path) -> None:
    slow = SlowTier()
    entries = [segment(32, seed) for seed in range(10)]
    store = TieredStore(FP, [DiskTier(tmp_path, 10**8), slow], write_queue_bytes=3 * entries[0][1].nbytes)
    for tokens, kv in entries[:3]:
        store.put("", tokens, kv)
    # The fast tier is not held back by the slow one.
    deadline = time.monotonic() + 10
    while store.stats()["disk"].writes < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats()["disk"].writes == 3 and store.stats()["slow"].writes == 0
    start = time.perf_counter()
    for tokens, kv in entries[3:]:
        store.put("", tokens, kv)
    assert time.perf_counter() - start < 0.5  # returns at once: encoding and writing happen elsewhere
    assert store.flush(timeout_s=0.2) is False
    slow.release.set()
    assert store.flush()
    s = store.stats()["slow"]
    # Its queue holds three entries' bytes (the one being written included): the rest was dropped.
    assert (s.writes, s.dropped_writes) == (3, 7)
    d = store.stats()["disk"]
    assert d.writes + d.dropped_writes == 10
    assert store.get("", entries[0][0]) is not None


def test_lookup_order_is_the_tier_order_and_misses_are_counted_per_tier(tmp_path: Path) -> None:
    tokens, kv = segment(8)
    first, second = DiskTier(tmp_path / "a", 10**7), DiskTier(tmp_path / "b", 10**7)
    second.name = "disk2"  # type: ignore[misc]
    only_second = TieredStore(FP, [second])
    only_second.put("", tokens, kv)
    assert only_second.flush()
    store = TieredStore(FP, [first, second])
    hit = store.get("", tokens)
    assert hit is not None and hit.tier == "disk2"
    stats = store.stats()
    assert (stats["disk"].misses, stats["disk2"].hits) == (1, 1)
    assert store.flush()
    assert store.get("", tokens).tier == "disk"  # type: ignore[union-attr]  # written back above


def test_breaker_closed_open_half_open_closed() -> None:
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=10.0, clock=lambda: now[0])
    assert breaker.allow() and breaker.state == "closed"
    breaker.failure()
    breaker.success()  # a success resets the streak
    breaker.failure()
    assert breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "open" and not breaker.allow()
    now[0] = 9.9
    assert not breaker.allow()
    now[0] = 10.0
    assert breaker.state == "half_open"
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one probe at a time
    breaker.failure()  # the probe failed: open again, for a full cooldown
    assert breaker.state == "open" and breaker.trips == 2
    now[0] = 20.0
    assert breaker.allow()
    breaker.success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_prometheus_metrics_per_tier(tmp_path: Path) -> None:
    tokens, kv = segment(8)
    store = TieredStore(FP, [DiskTier(tmp_path, 10**7)])
    store.put("", tokens, kv)
    assert store.flush()
    store.get("", tokens)
    store.get("", [1, 2, 3])
    registry = CollectorRegistry()
    register_store_metrics(registry, "gemma", store.stats)
    text = generate_latest(registry).decode()
    assert 'kvsplice:store_hits_total{model_name="gemma",tier="disk"} 1.0' in text
    assert 'kvsplice:store_misses_total{model_name="gemma",tier="disk"} 1.0' in text
    assert 'kvsplice:store_writes_total{model_name="gemma",tier="disk"} 1.0' in text
    assert 'kvsplice:store_corrupt_entries_total{model_name="gemma",tier="disk"} 0.0' in text
    for name in ("read_bytes", "written_bytes", "load_seconds", "errors", "dropped_writes", "evictions"):
        assert f"kvsplice:store_{name}_total{{" in text
