"""The self-describing entry: one segment's KV as bytes, its key, and the checks on every read.

Layout (format version 1), little-endian:

    b"KVSPLICE" | u16 version | u32 header length | header (msgpack) | zero padding to 64 bytes
    | payload: for each stored layer, K then V, each [tokens, kv_heads, head_dim] C-contiguous
    | blake2b-256 digest of everything before it

The header holds the fingerprint, the namespace (cache salt), the token ids, the stored dtype and,
per layer, the token range stored (or None: the layer is not stored): sliding-window layers may keep
only the tokens repair can read. The key is derived from version, fingerprint, namespace and token
ids; a read verifies the digest first, then that the header is the one the key was asked for, so a
corrupted value or one written under a forged key is never served.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from kvsplice.tiers.fingerprint import DTYPE_NAMES, KVFingerprint

FORMAT_VERSION = 1
MAGIC = b"KVSPLICE"
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
DIGEST_BYTES = 32
# The payload starts aligned, so every tensor is a view at an aligned offset.
ALIGN = 64
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_NAMES}


class CorruptEntryError(Exception):
    """Stored bytes that must not be served: bad digest, truncated, or not the entry asked for."""


@dataclass(frozen=True)
class LayerKV:
    """Tokens start .. start + len(k) - 1 of the segment, one layer. k, v: [tokens, kv_heads, head_dim]."""

    start: int
    k: torch.Tensor
    v: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.k.shape[0]


@dataclass(frozen=True)
class SegmentKV:
    """A segment's KV, per layer: all of its tokens, a range of them, or (None) nothing."""

    num_tokens: int
    layers: tuple[LayerKV | None, ...]

    @classmethod
    def full(cls, k: torch.Tensor, v: torch.Tensor) -> SegmentKV:
        """k, v: [layers, tokens, kv_heads, head_dim], every token of every layer."""
        return cls.select(k, v, [(0, k.shape[1])] * k.shape[0])

    @classmethod
    def select(cls, k: torch.Tensor, v: torch.Tensor, spans: Sequence[tuple[int, int] | None]) -> SegmentKV:
        """k, v: [layers, tokens, kv_heads, head_dim]; spans[layer]: (start, end) tokens to keep, or None."""
        assert k.shape == v.shape and k.dim() == 4 and len(spans) == k.shape[0], "k, v, spans disagree"
        layers = tuple(
            None if span is None else LayerKV(span[0], k[i, span[0] : span[1]], v[i, span[0] : span[1]])
            for i, span in enumerate(spans)
        )
        return cls(k.shape[1], layers)

    @property
    def nbytes(self) -> int:
        return sum(2 * layer.k.nbytes for layer in self.layers if layer is not None)

    def check(self, fingerprint: KVFingerprint) -> None:
        """Assert the layout matches the fingerprint's (a caller's bug otherwise)."""
        assert len(self.layers) == fingerprint.num_layers, "one entry per layer, None for a layer not stored"
        shape = (fingerprint.num_kv_heads, fingerprint.head_dim)
        for layer in self.layers:
            if layer is None:
                continue
            assert layer.k.shape == layer.v.shape and tuple(layer.k.shape[1:]) == shape, "bad layer shape"
            assert 0 <= layer.start <= layer.end <= self.num_tokens, "layer span outside the segment"


def entry_key(fingerprint: KVFingerprint, namespace: str, token_ids: Sequence[int]) -> str:
    """64 hex digits naming (format version, fingerprint, namespace, token ids)."""
    h = hashlib.blake2b(digest_size=32)
    h.update(FORMAT_VERSION.to_bytes(2, "little"))
    h.update(fingerprint.digest)
    ns = namespace.encode("utf-8")
    h.update(len(ns).to_bytes(4, "little") + ns)
    h.update(_token_bytes(token_ids))
    return h.hexdigest()


def encode_entry(
    fingerprint: KVFingerprint, namespace: str, token_ids: Sequence[int], kv: SegmentKV, store_dtype: str
) -> bytearray:
    """The entry's bytes; the KV is converted to `store_dtype`."""
    kv.check(fingerprint)
    assert kv.num_tokens == len(token_ids), "KV and token ids disagree on the segment's length"
    dtype = TORCH_DTYPES[store_dtype]
    header = msgpack.packb(
        {
            "fingerprint": fingerprint.to_wire(),
            "namespace": namespace,
            "tokens": _token_bytes(token_ids),
            "dtype": store_dtype,
            "layers": [None if layer is None else [layer.start, layer.end] for layer in kv.layers],
        }
    )
    offset = _payload_offset(len(header))
    elem = dtype.itemsize
    payload = sum(2 * layer.k.numel() * elem for layer in kv.layers if layer is not None)
    out = bytearray(offset + payload + DIGEST_BYTES)
    _PREFIX.pack_into(out, 0, MAGIC, FORMAT_VERSION, len(header))
    out[_PREFIX.size : _PREFIX.size + len(header)] = header
    for layer in kv.layers:
        if layer is None:
            continue
        for t in (layer.k, layer.v):
            if t.numel() == 0:
                continue  # torch.frombuffer refuses a count of 0
            # One pass: the copy converts to the stored dtype.
            torch.frombuffer(out, dtype=dtype, count=t.numel(), offset=offset).view(t.shape).copy_(t)
            offset += t.numel() * elem
    body = memoryview(out)[:offset]
    out[offset:] = hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()
    return out


def decode_entry(
    data: bytes | bytearray, fingerprint: KVFingerprint, namespace: str, token_ids: Sequence[int]
) -> SegmentKV:
    """The KV of the entry asked for, in the fingerprint's kv_dtype; CorruptEntryError if `data` is
    not exactly that entry, intact. `data` should be a bytearray: tensors are views into it."""
    if not isinstance(data, bytearray):
        data = bytearray(data)  # torch views need a writable buffer
    if len(data) < _PREFIX.size + DIGEST_BYTES:
        raise CorruptEntryError(f"truncated: {len(data)} bytes")
    view = memoryview(data)
    if hashlib.blake2b(view[:-DIGEST_BYTES], digest_size=DIGEST_BYTES).digest() != view[-DIGEST_BYTES:]:
        raise CorruptEntryError("digest mismatch")
    magic, version, header_len = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise CorruptEntryError(f"not a format-{FORMAT_VERSION} entry (magic {magic!r}, version {version})")
    try:
        header = msgpack.unpackb(view[_PREFIX.size : _PREFIX.size + header_len])
        layers = _check_header(header, fingerprint, namespace, token_ids)
    except (ValueError, TypeError, KeyError, msgpack.UnpackException) as err:
        raise CorruptEntryError(f"unreadable header: {err}") from err
    dtype = TORCH_DTYPES[header["dtype"]]
    kv_dtype = TORCH_DTYPES[fingerprint.kv_dtype]
    offset = _payload_offset(header_len)
    shape = (fingerprint.num_kv_heads, fingerprint.head_dim)
    tokens_stored = sum(end - start for start, end in filter(None, layers))
    expected = offset + 2 * tokens_stored * shape[0] * shape[1] * dtype.itemsize
    if expected + DIGEST_BYTES != len(data):
        raise CorruptEntryError(f"payload is {len(data)} bytes, its header says {expected + DIGEST_BYTES}")
    out: list[LayerKV | None] = []
    for span in layers:
        if span is None:
            out.append(None)
            continue
        n = (span[1] - span[0]) * shape[0] * shape[1]
        if n == 0:
            empty = torch.empty(0, *shape, dtype=kv_dtype)
            out.append(LayerKV(span[0], empty, empty.clone()))
            continue
        k = torch.frombuffer(data, dtype=dtype, count=n, offset=offset).view(-1, *shape)
        v = torch.frombuffer(data, dtype=dtype, count=n, offset=offset + n * dtype.itemsize).view(-1, *shape)
        offset += 2 * n * dtype.itemsize
        out.append(LayerKV(span[0], k.to(kv_dtype), v.to(kv_dtype)))
    return SegmentKV(len(token_ids), tuple(out))


def _check_header(
    header: dict[str, Any], fingerprint: KVFingerprint, namespace: str, token_ids: Sequence[int]
) -> list[tuple[int, int] | None]:
    """The per-layer spans, once the header is shown to be the entry asked for."""
    if header["fingerprint"] != fingerprint.to_wire():
        raise CorruptEntryError("written for another model, tokenizer, dtype, layout or context")
    if header["namespace"] != namespace:
        raise CorruptEntryError("written for another namespace")
    if header["tokens"] != _token_bytes(token_ids):
        raise CorruptEntryError("written for other token ids")
    if header["dtype"] not in TORCH_DTYPES:
        raise CorruptEntryError(f"unknown stored dtype {header['dtype']!r}")
    layers = header["layers"]
    if len(layers) != fingerprint.num_layers:
        raise CorruptEntryError(f"{len(layers)} layers, the fingerprint has {fingerprint.num_layers}")
    spans: list[tuple[int, int] | None] = []
    for span in layers:
        if span is not None and not (len(span) == 2 and 0 <= span[0] <= span[1] <= len(token_ids)):
            raise CorruptEntryError(f"layer span {span} outside a segment of {len(token_ids)} tokens")
        spans.append(None if span is None else (span[0], span[1]))
    return spans


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("q", token_ids).tobytes()


def _payload_offset(header_len: int) -> int:
    return -(-(_PREFIX.size + header_len) // ALIGN) * ALIGN


def salt_key(namespace: Hashable) -> str:
    """The part of a `namespace` that entries below the pool and KV events are keyed by: the cache salt
    ("" for none). The model part is the store fingerprint's: a path differs between machines that
    serve the same weights."""
    assert isinstance(namespace, tuple) and len(namespace) == 2, "a namespace is (model, cache_salt)"
    salt = namespace[1]
    return "" if salt is None else "salt:" + salt
