"""The store below the KV pool: tiers looked up in order, entries verified, writes in the background.

The engine asks `get` when a segment misses in its pool and `put` after it computed one. A hit in a
lower tier is written back to the tiers above it (in the background), so a segment fetched from the
remote tier is on local disk the next time. Every read is verified (`decode_entry`): an entry that
fails is deleted from that tier, counted as corrupt, and the lookup goes on as a miss there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.tiers.breaker import CircuitBreaker
from kvsplice.tiers.config import StoreConfig
from kvsplice.tiers.disk import DiskTier
from kvsplice.tiers.entry import (
    TORCH_DTYPES,
    CorruptEntryError,
    SegmentKV,
    decode_entry,
    encode_entry,
    entry_key,
)
from kvsplice.tiers.fingerprint import KVFingerprint
from kvsplice.tiers.remote import RedisTier
from kvsplice.tiers.tier import Tier, TierStats
from kvsplice.tiers.writer import Payload, TierWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreHit:
    """A segment found below the pool. `kv` is in the fingerprint's kv_dtype and owned by the caller."""

    kv: SegmentKV
    tier: str
    # Seconds to read, verify and decode it (the misses in tiers above included).
    load_s: float
    nbytes: int


class TieredStore:
    def __init__(
        self,
        fingerprint: KVFingerprint,
        tiers: Sequence[Tier],
        *,
        store_dtype: str | None = None,
        write_queue_bytes: int = 512 * 2**20,
    ) -> None:
        """tiers: fastest first. store_dtype: the dtype entries are written in (None: the KV's own)."""
        assert len({tier.name for tier in tiers}) == len(tiers), "tier names label metrics: one tier per name"
        self.fingerprint = fingerprint
        self.tiers = tuple(tiers)
        self.store_dtype = store_dtype or fingerprint.kv_dtype
        assert self.store_dtype in TORCH_DTYPES
        self._writers = [TierWriter(tier, write_queue_bytes) for tier in self.tiers]

    @classmethod
    def from_config(cls, config: StoreConfig, fingerprint: KVFingerprint) -> TieredStore:
        """Disk first, then Redis, as configured. Raises
        ConfigError at start-up if the directory is not writable or the Redis host does not resolve."""
        tiers: list[Tier] = []
        if config.store_dir is not None:
            tiers.append(DiskTier(config.store_dir, config.store_dir_bytes))
        if config.store_url is not None:
            breaker = CircuitBreaker(config.store_breaker_failures, config.store_breaker_cooldown_s)
            tiers.append(
                RedisTier(
                    config.store_url,
                    ttl_s=config.store_ttl_s,
                    timeout_s=config.store_timeout_s,
                    breaker=breaker,
                )
            )
        return cls(
            fingerprint,
            tiers,
            store_dtype=config.store_dtype,
            write_queue_bytes=config.store_write_queue_bytes,
        )

    def get(self, namespace: str, token_ids: Sequence[int]) -> StoreHit | None:
        """The segment's KV from the first tier that holds a valid entry, or None. Never raises for
        what a tier does; blocks for at most the tiers' timeouts (an open circuit costs nothing)."""
        if not self.tiers:
            return None
        key = entry_key(self.fingerprint, namespace, token_ids)
        start = time.perf_counter()
        for i, tier in enumerate(self.tiers):
            tier_start = time.perf_counter()
            data = tier.get(key)
            if data is None:
                tier.counters.add(misses=1)
                continue
            try:
                kv = decode_entry(data, self.fingerprint, namespace, token_ids)
            except CorruptEntryError as err:
                logger.warning("store tier %s: entry %s deleted, not served: %s", tier.name, key, err)
                tier.counters.add(corrupt=1, misses=1)
                tier.delete(key)
                continue
            tier.counters.add(hits=1, load_seconds=time.perf_counter() - tier_start)
            for writer in self._writers[:i]:
                writer.submit(key, Payload.ready(data))
            return StoreHit(kv, tier.name, time.perf_counter() - start, len(data))
        return None

    def put(self, namespace: str, token_ids: Sequence[int], kv: SegmentKV) -> None:
        """Write the segment to every tier in the background and return at once.

        The store holds on to `kv`'s tensors until they are written: pass tensors nothing will
        overwrite (copies out of the pool, not views of its slots)."""
        if not self.tiers:
            return
        kv.check(self.fingerprint)
        assert kv.num_tokens == len(token_ids), "KV and token ids disagree on the segment's length"
        key = entry_key(self.fingerprint, namespace, token_ids)
        tokens = tuple(token_ids)
        itemsize = TORCH_DTYPES[self.store_dtype].itemsize
        nbytes = sum(2 * layer.k.numel() * itemsize for layer in kv.layers if layer is not None)
        payload = Payload(
            nbytes, lambda: encode_entry(self.fingerprint, namespace, tokens, kv, self.store_dtype)
        )
        for writer in self._writers:
            writer.submit(key, payload)

    def blobs(self, key: str) -> list[bytes]:
        """What each tier holds under `key` (not a segment entry: small shared state, such as the trust
        gate's samples), fastest tier first; blocks for at most the tiers' timeouts."""
        found = []
        for tier in self.tiers:
            data = tier.get(key)
            if data is not None:
                found.append(bytes(data))
        return found

    def put_blob(self, key: str, data: bytes) -> None:
        """Write `data` under `key` to every tier in the background (`blobs` reads it back)."""
        for writer in self._writers:
            writer.submit(key, Payload.ready(data))

    def stats(self) -> dict[str, TierStats]:
        """A snapshot per tier, by tier name."""
        return {tier.name: tier.counters.snapshot() for tier in self.tiers}

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait for the queued writes of every tier; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        return all(writer.flush(max(0.0, deadline - time.monotonic())) for writer in self._writers)

    def close(self, timeout_s: float = 5.0) -> None:
        """Finish queued writes for up to `timeout_s` in all, then release the tiers."""
        deadline = time.monotonic() + timeout_s
        for writer in self._writers:
            writer.close(max(0.0, deadline - time.monotonic()))
        for tier in self.tiers:
            tier.close()
