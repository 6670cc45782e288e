"""The segment store's tiers below the KV pool (disk, Redis), seen from the reuse path.

    promote(namespace, tokens)        a pool miss asks the tiers; a hit is written into blocks of the
                                      pool's segment store, so it is spliced exactly like a memory hit
    write_through(namespace, tokens)  a segment that entered the pool's store is copied out and put
                                      to every tier in the background (TieredStore's writer threads)

Entries hold what the pool's segment store holds: each token's KV at its canonical position (keys
after RoPE), so a promotion is a plain copy into fresh blocks. The fingerprint names everything that
makes that KV valid (weights, tokenizer, dtypes, layout, RoPE, canonical context): two engines share
entries only when all of it is equal.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsplice.cache.segments import SegmentStore
from kvsplice.config import EngineConfig
from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.pool import KVPool
from kvsplice.model_config import ModelConfig
from kvsplice.reuse import segment_kv
from kvsplice.tiers import KVFingerprint, SegmentKV, TieredStore
from kvsplice.tiers.entry import salt_key

# Written by loader/gguf.py next to a converted model: it names the GGUF's sha256.
CONVERSION_MARKER = "kvsplice-conversion.json"


@dataclass(frozen=True)
class Promotion:
    """A segment a request found below the pool: how many tokens, in which tier, at what cost."""

    num_tokens: int
    tier: str
    load_s: float
    namespace: Hashable
    tokens: tuple[int, ...]


class LowerTiers:
    def __init__(self, store: TieredStore, segments: SegmentStore, pool: KVPool) -> None:
        self.store = store
        self.segments = segments
        self.pool = pool

    def promote(self, namespace: Hashable, tokens: tuple[int, ...]) -> Promotion | None:
        """Load a segment the pool's store lacks into it; None if no tier holds a valid entry, the entry
        is not a whole one, or the pool has no memory to spare (the segment is then computed)."""
        assert not self.segments.contains(namespace, tokens), "promote only what the pool lacks"
        hit = self.store.get(salt_key(namespace), tokens)
        if hit is None:
            return None
        n = len(tokens)
        # This engine writes every token of every layer; an entry with less (another writer's
        # sliding-window trimming) would leave slots unwritten, so it is a miss here.
        if any(layer is None or (layer.start, layer.end) != (0, n) for layer in hit.kv.layers):
            return None
        try:
            blocks = self.pool.allocator.allocate(-(-n // self.pool.block_size))
        except OutOfBlocksError:
            return None
        slots = self.pool.slots(blocks, torch.arange(n, device=self.pool.device))
        for i, layer in enumerate(hit.kv.layers):
            assert layer is not None
            self.pool.write(i, slots, layer.k.to(self.pool.device), layer.v.to(self.pool.device))
        self.segments.insert(namespace, tokens, blocks)
        return Promotion(n, hit.tier, hit.load_s, namespace, tokens)

    def write_through(self, namespace: Hashable, tokens: tuple[int, ...]) -> None:
        """Put a segment the pool's store holds to the tiers below; returns at once."""
        entry = self.segments.peek(namespace, tokens)
        assert entry is not None, "write through only what the pool's store holds"
        slots = self.pool.slots(entry.blocks, torch.arange(len(tokens), device=self.pool.device))
        # Indexing copies: the writer threads keep tensors that no later step overwrites.
        # [layers, tokens, kv_heads, head_dim]
        k, v = self.pool.k[:, slots].cpu(), self.pool.v[:, slots].cpu()
        self.store.put(salt_key(namespace), tokens, SegmentKV.full(k, v))

    def close(self) -> None:
        """Finish queued writes (for a few seconds at most), then release the tiers."""
        self.store.close()


def store_fingerprint(
    model_dir: Path, cfg: ModelConfig, config: EngineConfig, context: tuple[int, ...]
) -> KVFingerprint:
    """The fingerprint of this engine's stored KV."""
    rope = ";".join(
        f"{kind}:theta={spec.theta!r},scaling={sorted(spec.scaling_dict().items())!r}"
        for kind, spec in sorted(cfg.rope.items())
    )
    layers = ",".join(cfg.layer_types)
    return KVFingerprint(
        model_hash=_model_hash(model_dir),
        tokenizer_hash=_files_hash(model_dir, ["tokenizer.json", "tokenizer_config.json"]) or "none",
        compute_dtype=config.dtype,
        kv_dtype=config.kv_dtype,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        rope=f"layers={layers};window={cfg.sliding_window};{rope}",
        context_tokens=context,
        segment_contexts=segment_kv.CONTEXTS,
    )


def _model_hash(model_dir: Path) -> str:
    """config.json plus the weights: a converted GGUF by the sha256 its conversion recorded (hashing
    the safetensors again would cost a second per start), other directories by their safetensors."""
    marker = model_dir / CONVERSION_MARKER
    config = _files_hash(model_dir, ["config.json"])
    if marker.is_file():
        converted = json.loads(marker.read_text())
        return f"gguf:{converted['sha256']}:v{converted['version']}:config:{config}"
    weights = _files_hash(model_dir, sorted(p.name for p in model_dir.glob("*.safetensors")))
    return f"safetensors:{weights}:config:{config}"


def _files_hash(directory: Path, names: list[str]) -> str:
    """sha256 over the named files that exist (name and content of each); "" if none does."""
    h = hashlib.sha256()
    found = False
    for name in names:
        path = directory / name
        if path.is_file():
            found = True
            h.update(name.encode() + b"\0")
            with open(path, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest() if found else ""
