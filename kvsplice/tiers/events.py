"""KV events in vLLM's wire format, plus kvsplice's segment events, and the hashes routers match on.

vLLM (`vllm/distributed/kv_events.py`) encodes with msgspec, `array_like=True, tag=True`: a batch is
the msgpack array [ts (float64), [event, ...], data_parallel_rank], and an event is an array whose
first element is its tag (the class name) followed by its fields in declaration order:

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

kvsplice adds two events of its own, in the same shape:

    ["SegmentStored", segment_hash, num_tokens, medium]
    ["SegmentRemoved", segment_hash, medium]

Block hashes are unsigned 64-bit integers, as vLLM publishes them by default (the low 64 bits of its
SHA-256 block hash). `medium` None means the engine's own KV pool (vLLM: the GPU cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

U64 = (1 << 64) - 1


@dataclass(frozen=True)
class BlockStored:
    TAG: ClassVar[str] = "BlockStored"
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    # The stored blocks' tokens, block after block: len == block_size * len(block_hashes).
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None

    def __post_init__(self) -> None:
        assert len(self.token_ids) == self.block_size * len(self.block_hashes), "one full block per hash"
        _check_hashes(self.block_hashes)
        _check_hashes(() if self.parent_block_hash is None else (self.parent_block_hash,))

    def to_wire(self) -> list[Any]:
        return [self.TAG, list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
                self.block_size, self.lora_id, self.medium, self.lora_name]  # fmt: skip


@dataclass(frozen=True)
class BlockRemoved:
    TAG: ClassVar[str] = "BlockRemoved"
    block_hashes: tuple[int, ...]
    medium: str | None = None

    def __post_init__(self) -> None:
        _check_hashes(self.block_hashes)

    def to_wire(self) -> list[Any]:
        return [self.TAG, list(self.block_hashes), self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    TAG: ClassVar[str] = "AllBlocksCleared"

    def to_wire(self) -> list[Any]:
        return [self.TAG]


@dataclass(frozen=True)
class SegmentStored:
    TAG: ClassVar[str] = "SegmentStored"
    # `segment_hash(namespace, token_ids)`: a router computes it from a request's segment tokens.
    segment_hash: int
    num_tokens: int
    medium: str | None = None

    def __post_init__(self) -> None:
        _check_hashes((self.segment_hash,))

    def to_wire(self) -> list[Any]:
        return [self.TAG, self.segment_hash, self.num_tokens, self.medium]


@dataclass(frozen=True)
class SegmentRemoved:
    TAG: ClassVar[str] = "SegmentRemoved"
    segment_hash: int
    medium: str | None = None

    def __post_init__(self) -> None:
        _check_hashes((self.segment_hash,))

    def to_wire(self) -> list[Any]:
        return [self.TAG, self.segment_hash, self.medium]


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared
SegmentEvent = SegmentStored | SegmentRemoved
KVEvent = BlockEvent | SegmentEvent


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int) -> bytes:
    """One batch's msgpack bytes. The rank is always written: some decoders require three fields."""
    return msgpack.packb([float(ts), [event.to_wire() for event in events], data_parallel_rank])


def external_block_hash(digest: bytes) -> int:
    """A block hash as vLLM publishes it: the low 64 bits of the digest, read big-endian."""
    return int.from_bytes(digest, "big") & U64


def segment_hash(namespace: str, token_ids: Sequence[int]) -> int:
    """A segment's content hash in events: blake2b-64 over the namespace and the token ids (int64 LE)."""
    h = hashlib.blake2b(b"kvsplice.segment.v1", digest_size=8)
    ns = namespace.encode("utf-8")
    h.update(len(ns).to_bytes(4, "little") + ns)
    h.update(b"".join(t.to_bytes(8, "little", signed=True) for t in token_ids))
    return int.from_bytes(h.digest(), "big")


def router_block_hashes(token_ids: Sequence[int], block_size: int, hash_seed: str = "") -> list[int]:
    """Prefix block hashes as llm-d's KV-cache indexer computes them from a prompt, so that the
    hashes kvsplice publishes match the ones it looks up: for each full block, the low 64 bits of
    SHA-256 over the canonical CBOR of [parent, block token ids, null]; the first parent is the low
    64 bits of SHA-256 over the CBOR of `hash_seed` (vLLM's PYTHONHASHSEED)."""
    parent = external_block_hash(hashlib.sha256(_cbor(hash_seed)).digest())
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = list(token_ids[start : start + block_size])
        parent = external_block_hash(hashlib.sha256(_cbor([parent, block, None])).digest())
        hashes.append(parent)
    return hashes


def _cbor(value: Any) -> bytes:
    """Canonical CBOR (RFC 8949 §4.2.1) of None, unsigned ints, text strings and lists of these."""
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        assert 0 <= value <= U64
        return _cbor_head(0, value)
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return _cbor_head(3, len(raw)) + raw
    if isinstance(value, list):
        return _cbor_head(4, len(value)) + b"".join(_cbor(v) for v in value)
    raise TypeError(f"cannot CBOR-encode {type(value).__name__}")


def _cbor_head(major: int, n: int) -> bytes:
    """The initial byte(s) of a CBOR item in its shortest form."""
    if n < 24:
        return bytes([major << 5 | n])
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([major << 5 | info]) + n.to_bytes(size, "big")
    raise ValueError(f"{n} does not fit a CBOR head")


def _check_hashes(hashes: Sequence[int]) -> None:
    assert all(0 <= h <= U64 for h in hashes), "block hashes are unsigned 64-bit integers"
