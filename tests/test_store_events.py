"""KV events on the wire, checked by a decoder written here from vLLM's published schema
(`vllm/distributed/kv_events.py`: msgspec structs with array_like=True, tag=True; ZMQ PUB frames
topic | seq (8 bytes, big-endian) | payload; the ROUTER replay protocol), not with the encoder's
library: the type byte of every msgpack item is read by hand, as Dynamo's and llm-d's decoders
(rmp_serde, Go msgpack) would see it."""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from kvsplice.errors import ConfigError
from kvsplice.tiers import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventPublisher,
    KVEventsConfig,
    SegmentRemoved,
    SegmentStored,
    encode_batch,
    external_block_hash,
    router_block_hashes,
    segment_hash,
)


class Msgpack:
    """A msgpack reader for the subset vLLM's events use; records the type byte of each item."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.types = data, 0, []  # type: ignore[var-annotated]

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        assert len(out) == n, "truncated msgpack"
        self.pos += n
        return out

    def item(self) -> Any:
        b = self.take(1)[0]
        self.types.append(b)
        if b <= 0x7F:
            return b
        if b >= 0xE0:
            return b - 0x100
        if 0x90 <= b <= 0x9F:
            return [self.item() for _ in range(b & 0x0F)]
        if 0xA0 <= b <= 0xBF:
            return self.take(b & 0x1F).decode()
        if 0x80 <= b <= 0x8F:
            raise AssertionError("a msgpack map: vLLM's array_like structs never encode as maps")
        fixed = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i",
                 0xD3: ">q", 0xCA: ">f", 0xCB: ">d"}  # fmt: skip
        if b in fixed:
            fmt = fixed[b]
            return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        if b == 0xC0:
            return None
        if b in (0xC2, 0xC3):
            return b == 0xC3
        if b in (0xD9, 0xDA, 0xDB):
            n = int.from_bytes(self.take({0xD9: 1, 0xDA: 2, 0xDB: 4}[b]), "big")
            return self.take(n).decode()
        if b in (0xDC, 0xDD):
            n = int.from_bytes(self.take({0xDC: 2, 0xDD: 4}[b]), "big")
            return [self.item() for _ in range(n)]
        raise AssertionError(f"unexpected msgpack type byte {b:#x}")


def u64(x: Any) -> bool:
    return isinstance(x, int) and 0 <= x < 2**64


def opt(check: Any) -> Any:
    return lambda x: x is None or check(x)


def is_str(x: Any) -> bool:
    return isinstance(x, str)


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def list_of(check: Any) -> Any:
    return lambda x: isinstance(x, list) and all(check(v) for v in x)


# vLLM's field order per tag (and kvsplice's two segment events, same shape).
SCHEMA = {
    "BlockStored": [list_of(u64), opt(u64), list_of(is_int), is_int, opt(is_int), opt(is_str), opt(is_str)],
    "BlockRemoved": [list_of(u64), opt(is_str)],
    "AllBlocksCleared": [],
    "SegmentStored": [u64, is_int, opt(is_str)],
    "SegmentRemoved": [u64, opt(is_str)],
}
VLLM_TAGS = {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def decode_batch(payload: bytes) -> tuple[float, list[list[Any]], int]:
    reader = Msgpack(payload)
    batch = reader.item()
    assert reader.pos == len(payload), "trailing bytes"
    assert reader.types[0] == 0x93, "a batch is a 3-element array [ts, events, data_parallel_rank]"
    assert reader.types[1] == 0xCB, "ts is a float64"
    ts, events, rank = batch
    for event in events:
        tag, *fields = event
        assert tag in SCHEMA, f"unknown tag {tag}"
        assert len(fields) == len(SCHEMA[tag]), f"{tag}: {len(fields)} fields"
        assert all(check(value) for check, value in zip(SCHEMA[tag], fields, strict=True)), event
    return ts, events, rank


def test_batch_bytes_follow_the_schema() -> None:
    big = 2**64 - 5  # needs uint64 on the wire
    events: list[KVEvent] = [
        BlockStored((big, 7), None, tuple(range(8)), 4, medium=None),
        BlockStored((9,), big, (1, 2, 3, 4), 4, lora_id=3, medium="CPU", lora_name="ad"),
        BlockRemoved((big,), "GPU"),
        AllBlocksCleared(),
        SegmentStored(segment_hash("", [1, 2]), 2),
        SegmentRemoved(123),
    ]
    payload = encode_batch(1700000000.25, events, 0)
    ts, decoded, rank = decode_batch(payload)
    assert (ts, rank) == (1700000000.25, 0)
    assert decoded[0] == ["BlockStored", [big, 7], None, list(range(8)), 4, None, None, None]
    assert decoded[1] == ["BlockStored", [9], big, [1, 2, 3, 4], 4, 3, "CPU", "ad"]
    assert decoded[2] == ["BlockRemoved", [big], "GPU"]
    assert decoded[3] == ["AllBlocksCleared"]
    assert decoded[4] == ["SegmentStored", segment_hash("", [1, 2]), 2, None]
    assert decoded[5] == ["SegmentRemoved", 123, None]
    # The big hash is a uint64 (0xcf followed by 8 big-endian bytes), as rmp_serde / Go expect.
    assert b"\xcf" + big.to_bytes(8, "big") in payload


def test_block_hashes_and_segment_hashes() -> None:
    digest = hashlib.sha256(b"block").digest()
    assert external_block_hash(digest) == int.from_bytes(digest[-8:], "big")
    a = segment_hash("", [1, 2, 3])
    assert a == segment_hash("", (1, 2, 3)) and u64(a)
    assert len({a, segment_hash("t", [1, 2, 3]), segment_hash("", [1, 2, 4]), segment_hash("", [1, 2])}) == 4


def test_router_block_hashes_are_sha256_of_canonical_cbor() -> None:
    """Built here byte by byte from RFC 8949: [parent (uint64), tokens (uints), null]."""
    seed = hashlib.sha256(b"\x60").digest()  # CBOR of "" is 0x60
    root = int.from_bytes(seed[-8:], "big")
    assert root >= 2**32  # so it is encoded as 0x1b + 8 bytes below

    def block_bytes(parent: int, tokens: list[int]) -> bytes:
        out = b"\x83" + b"\x1b" + parent.to_bytes(8, "big") + bytes([0x80 | len(tokens)])
        for t in tokens:  # 0..23 in the head byte, then 0x18 + 1 byte, 0x19 + 2 bytes
            out += (
                bytes([t]) if t < 24 else b"\x18" + bytes([t]) if t < 256 else b"\x19" + t.to_bytes(2, "big")
            )
        return out + b"\xf6"

    tokens = [1, 30, 300, 5, 6, 7, 8, 9, 10]
    first = int.from_bytes(hashlib.sha256(block_bytes(root, tokens[:4])).digest()[-8:], "big")
    second = int.from_bytes(hashlib.sha256(block_bytes(first, tokens[4:8])).digest()[-8:], "big")
    assert router_block_hashes(tokens, 4) == [first, second]  # the partial block is not hashed
    assert router_block_hashes(tokens, 4, hash_seed="42") != [first, second]


def test_config_errors() -> None:
    with pytest.raises(ConfigError):
        KVEventsConfig(endpoint="http://localhost:5557")
    with pytest.raises(ConfigError):
        KVEventsConfig(buffer_steps=0)
    assert KVEventsConfig().binds and not KVEventsConfig(endpoint="tcp://127.0.0.1:5557").binds


def recv(sub: zmq.Socket, timeout_s: float = 2.0) -> list[bytes] | None:
    return sub.recv_multipart() if sub.poll(int(timeout_s * 1000)) else None


def test_publisher_frames_sequence_numbers_split_batches_and_replay(tmp_path: Path) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.bind("tcp://127.0.0.1:*")  # the router binds, kvsplice connects (llm-d's central indexer)
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    replay_endpoint = f"ipc://{tmp_path}/replay"
    config = KVEventsConfig(endpoint=endpoint, replay_endpoint=replay_endpoint, topic="kv@pod-1@gemma")
    publisher = KVEventPublisher(config, ctx)
    try:
        # A PUB drops what it sends before the subscription is up: send until one arrives.
        deadline = time.monotonic() + 10
        while recv(sub, 0.05) is None:
            publisher.publish([AllBlocksCleared()])
            assert time.monotonic() < deadline, "no event arrived"
        while recv(sub, 0.2) is not None:
            pass
        stored = BlockStored((11, 12), None, tuple(range(8)), 4)
        publisher.publish([stored, SegmentStored(99, 300), BlockRemoved((11,)), SegmentRemoved(99)])
        frames = [recv(sub), recv(sub)]
        assert all(f is not None and len(f) == 3 for f in frames)
        topics, seqs, payloads = zip(*frames, strict=True)  # type: ignore[misc]
        assert set(topics) == {b"kv@pod-1@gemma"}
        assert all(len(s) == 8 for s in seqs)
        n0, n1 = (int.from_bytes(s, "big") for s in seqs)
        assert n1 == n0 + 1 and n0 >= 1
        blocks, segments = (decode_batch(p)[1] for p in payloads)
        # Block events and segment events travel in batches of their own, each in publish order.
        assert [e[0] for e in blocks] == ["BlockStored", "BlockRemoved"]
        assert [e[0] for e in segments] == ["SegmentStored", "SegmentRemoved"]
        assert blocks[0] == ["BlockStored", [11, 12], None, list(range(8)), 4, None, None, None]
        assert segments[0] == ["SegmentStored", 99, 300, None]

        # A subscriber that missed batches asks for them from a sequence number on.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            reply = recv(dealer)
            assert reply is not None and len(reply) == 3 and reply[0] == b""
            if reply[1] == (-1).to_bytes(8, "big", signed=True):
                assert reply[2] == b""
                break
            replayed.append((int.from_bytes(reply[1], "big"), reply[2]))
        assert [s for s, _ in replayed] == list(range(n1 + 1))
        assert replayed[n0][1] == payloads[0] and replayed[n1][1] == payloads[1]
        assert all(e[0] in VLLM_TAGS for e in decode_batch(replayed[0][1])[1])
        dealer.close(linger=0)
        assert publisher.stats.replays_served == 1 and publisher.stats.batches_dropped == 0
        assert publisher.stats.batches_published == n1 + 1
    finally:
        publisher.close()
        sub.close(linger=0)
        ctx.term()


def test_a_busy_address_is_a_start_up_error() -> None:
    ctx = zmq.Context()
    holder = ctx.socket(zmq.PUB)
    holder.bind("tcp://127.0.0.1:*")
    port = holder.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    try:
        with pytest.raises(ConfigError, match="cannot open"):
            KVEventPublisher(KVEventsConfig(endpoint=f"tcp://*:{port}"), ctx)
    finally:
        holder.close(linger=0)
        ctx.term()
