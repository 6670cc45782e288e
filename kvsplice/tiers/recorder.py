"""The engine's KV events: what its prefix cache and segment store report, as vLLM-format events.

The recorder listens to the prefix cache (whole blocks stored or removed) and to the pool's segment
store (segments stored or removed), collects events during an engine step and publishes them at its
end, one batch per step as vLLM does. Block hashes are the ones llm-d's indexer computes from a
prompt (`router_block_hashes`), so a router matches them without knowing kvsplice; a salted
namespace hashes from a seed of its own, as vLLM's cache_salt does, so its blocks match no request
of another tenant.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from kvsplice.tiers.entry import salt_key
from kvsplice.tiers.events import (
    BlockRemoved,
    BlockStored,
    KVEvent,
    SegmentRemoved,
    SegmentStored,
    router_block_hashes,
    segment_hash,
)
from kvsplice.tiers.publisher import KVEventPublisher


class KVEventRecorder:
    """A `BlockListener` and a `StoreWatcher` (cache/base.py, cache/segments.py)."""

    def __init__(self, publisher: KVEventPublisher, block_size: int, hash_seed: str = "") -> None:
        """hash_seed: llm-d's HashSeed (vLLM's PYTHONHASHSEED), "" by default on both sides."""
        self.publisher = publisher
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._pending: list[KVEvent] = []
        # The hash each cached block was published under, to name it again when it is removed.
        self._hash_of_block: dict[int, int] = {}

    def blocks_stored(
        self, namespace: Hashable, keys: Sequence[int], first: int, blocks: Sequence[int]
    ) -> None:
        end = first + len(blocks)
        bs = self.block_size
        # The chain is hashed from its start: a block's hash names its whole prefix.
        hashes = router_block_hashes(keys[: end * bs], bs, self._seed(namespace))
        for block, block_hash in zip(blocks, hashes[first:], strict=True):
            assert block not in self._hash_of_block, f"block {block} stored twice"
            self._hash_of_block[block] = block_hash
        parent = hashes[first - 1] if first > 0 else None
        tokens = tuple(keys[first * bs : end * bs])
        self._pending.append(BlockStored(tuple(hashes[first:]), parent, tokens, bs))

    def blocks_removed(self, blocks: Sequence[int]) -> None:
        hashes = tuple(self._hash_of_block.pop(block) for block in blocks)
        self._pending.append(BlockRemoved(hashes))

    def inserted(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        self._pending.append(SegmentStored(segment_hash(salt_key(namespace), tokens), len(tokens)))

    def evicted(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        self._pending.append(SegmentRemoved(segment_hash(salt_key(namespace), tokens)))

    def flush(self) -> None:
        """Publish what the step recorded (never blocks)."""
        if self._pending:
            self.publisher.publish(self._pending)
            self._pending = []

    def close(self) -> None:
        self.flush()
        self.publisher.close()

    def _seed(self, namespace: Hashable) -> str:
        salt = salt_key(namespace)
        return self.hash_seed if not salt else f"{self.hash_seed}|{salt}"
