"""What makes stored KV valid: two engines may share an entry only if all of it is equal.

The engine fills a `KVFingerprint` once at start-up. Every entry carries it and every key is derived
from it, so KV computed by another model, tokenizer, dtype, layout, RoPE, canonical context or way
or number of contexts can never be found, let alone served.
"""

from __future__ import annotations

import hashlib
from dataclasses import astuple, dataclass, fields
from functools import cached_property
from typing import Any

import msgpack

from kvsplice.errors import ConfigError

DTYPE_NAMES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class KVFingerprint:
    # A hash of the model's weights and its config (anything that changes the computed KV).
    model_hash: str
    # A hash of the tokenizer (its vocabulary and rules decide what a segment's token ids mean).
    tokenizer_hash: str
    # dtype the model computes in, and dtype of the KV it produces (the pool's dtype).
    compute_dtype: str
    kv_dtype: str
    # KV layout: one K and one V of [kv_heads, head_dim] per layer and token. The block size is not
    # part of it: entries hold tokens, not blocks.
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # A canonical text of the RoPE parameters of every layer type (theta, scaling), as the engine
    # writes it: keys are stored after RoPE, so a different RoPE means different keys.
    rope: str
    # The canonical context every segment is computed after (its KV depends on it).
    context_tokens: tuple[int, ...]
    # How many contexts a segment's KV is the mean over (reuse/segment_kv.CONTEXTS).
    segment_contexts: int

    def __post_init__(self) -> None:
        if self.compute_dtype not in DTYPE_NAMES or self.kv_dtype not in DTYPE_NAMES:
            raise ConfigError(f"fingerprint dtypes must be in {DTYPE_NAMES}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ConfigError("fingerprint layout sizes must be >= 1")
        if not isinstance(self.segment_contexts, int) or self.segment_contexts < 1:
            raise ConfigError(
                f"fingerprint segment_contexts must be an int >= 1, not {self.segment_contexts!r}"
            )
        if not self.model_hash or not self.tokenizer_hash:
            raise ConfigError("fingerprint needs a model hash and a tokenizer hash")

    def to_wire(self) -> list[Any]:
        """The fields in declaration order, as msgpack-able values (an entry's header holds this)."""
        return [list(v) if isinstance(v, tuple) else v for v in astuple(self)]

    @classmethod
    def from_wire(cls, values: list[Any]) -> KVFingerprint:
        names = [f.name for f in fields(cls)]
        if not isinstance(values, list) or len(values) != len(names):
            raise ValueError("fingerprint: wrong number of fields")
        kwargs = dict(zip(names, values, strict=True))
        kwargs["context_tokens"] = tuple(kwargs["context_tokens"])
        return cls(**kwargs)

    @cached_property
    def digest(self) -> bytes:
        """32 bytes naming this fingerprint (msgpack of ints, strs and lists is canonical); computed
        once, as every key derivation starts from it."""
        return hashlib.blake2b(msgpack.packb(self.to_wire()), digest_size=32).digest()
