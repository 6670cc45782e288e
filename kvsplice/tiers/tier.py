"""The interface every storage tier implements, and its counters.

A tier is a byte store keyed by an entry key (64 hex digits). It never raises to its caller for
what the outside world does (a full disk, a dead server): it counts an error and answers as if the
entry were missing. Whether the bytes are a valid entry is the `TieredStore`'s business, which also
counts hits, misses, corrupt entries and load time here, so one `TierStats` tells the whole story.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    # Entries found but not served: bad digest, truncated, or another entry's header (then deleted).
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    # Seconds spent in lookups that hit: reading, verifying and decoding.
    load_seconds: float = 0.0
    # Failed operations (I/O errors, timeouts, refused connections).
    errors: int = 0
    # Writes dropped before reaching the tier: its queue was full, or the entry exceeds its budget.
    dropped_writes: int = 0
    # Entries deleted to stay within the tier's byte budget.
    evictions: int = 0
    # Calls not made because the tier's circuit breaker was open.
    skipped: int = 0


class TierCounters:
    """A tier's `TierStats`, updated from the engine thread and the writer threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TierStats()

    def add(self, **increments: float) -> None:
        with self._lock:
            for name, value in increments.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def error(self, tier: str, what: str, err: BaseException) -> None:
        """Count a failed operation; log the 1st, 2nd, 4th, 8th ... so a dead tier cannot flood the log."""
        with self._lock:
            self._stats.errors += 1
            n = self._stats.errors
        if n & (n - 1) == 0:
            logger.warning("store tier %s: %s failed (%d errors so far): %s", tier, what, n, err)

    def snapshot(self) -> TierStats:
        with self._lock:
            return dataclasses.replace(self._stats)


class Tier(ABC):
    """A byte store below the KV pool. Every method is thread-safe and returns rather than raises."""

    # The tier's label in metrics ("disk", "redis").
    name: ClassVar[str]

    def __init__(self) -> None:
        self.counters = TierCounters()

    @abstractmethod
    def get(self, key: str) -> bytes | bytearray | None:
        """The bytes stored under `key`, or None (missing, or the tier failed: an error is counted)."""

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray) -> bool:
        """Store `data` under `key` atomically: a reader sees the old value, the new one, or none,
        never a part. False if it was not stored (counted as an error or a dropped write)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` if present."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and files (the tier is not used afterwards)."""
