"""Segment KV below the pool: self-describing entries in a disk and a Redis tier, and KV events.

- `KVFingerprint`: everything that makes KV valid (the engine fills it once).
- `SegmentKV` / `LayerKV`: a segment's KV, per layer all tokens, a range, or nothing.
- `TieredStore`: get (tiers in order, verified), put (write-through in the background), stats.
- `DiskTier`, `RedisTier` behind `Tier`; `StoreConfig` builds them.
- `KVEventPublisher`: vLLM's KV events (plus segment events) over ZeroMQ for KV-aware routers.
- `register_store_metrics`: the tiers' counters in a Prometheus registry.
"""

from kvsplice.tiers.config import StoreConfig
from kvsplice.tiers.disk import DiskTier
from kvsplice.tiers.entry import CorruptEntryError, LayerKV, SegmentKV, decode_entry, encode_entry, entry_key
from kvsplice.tiers.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    SegmentRemoved,
    SegmentStored,
    encode_batch,
    external_block_hash,
    router_block_hashes,
    segment_hash,
)
from kvsplice.tiers.fingerprint import KVFingerprint
from kvsplice.tiers.metrics import register_store_metrics
from kvsplice.tiers.publisher import KVEventPublisher, KVEventsConfig, PublisherStats
from kvsplice.tiers.remote import RedisTier
from kvsplice.tiers.tier import Tier, TierStats
from kvsplice.tiers.tiered import StoreHit, TieredStore

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CorruptEntryError",
    "DiskTier",
    "KVEvent",
    "KVEventPublisher",
    "KVEventsConfig",
    "KVFingerprint",
    "LayerKV",
    "PublisherStats",
    "RedisTier",
    "SegmentKV",
    "SegmentRemoved",
    "SegmentStored",
    "StoreConfig",
    "StoreHit",
    "Tier",
    "TierStats",
    "TieredStore",
    "decode_entry",
    "encode_batch",
    "encode_entry",
    "entry_key",
    "external_block_hash",
    "register_store_metrics",
    "router_block_hashes",
    "segment_hash",
]
