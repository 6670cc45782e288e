"""One forward pass's view of the KV pool: where its queries write and which keys they read.

The model's layers call `ctx.rope(layer)` for the cos/sin of their queries' positions and
`ctx.attention(layer, q, k, v)`, which writes the queries' own K/V into their slots first and then
attends over every key of each sequence through the one attention primitive. An optional observer
(a probing repair policy) sees the new K/V of chosen layers before they overwrite what the slots held.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvsplice.kv import rope
from kvsplice.kv.attention import attend
from kvsplice.kv.pool import KVPool
from kvsplice.model_config import ModelConfig


class LayerObserver(Protocol):
    """Watches the queries and new K/V of a pass on `layers`, before the K/V are written to the pool."""

    layers: frozenset[int]

    def observe(
        self, layer: int, ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None: ...


class KVShift(Protocol):
    """Moves pool K/V of tokens a pass does not recompute, on a layer, before its attention reads them
    (the segment shift of repair: repair/shift.py)."""

    def apply(
        self,
        layer: int,
        positions: torch.Tensor,
        key_slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool_k: torch.Tensor,
        pool_v: torch.Tensor,
        freq: torch.Tensor,
        rope_kind: str,
    ) -> None: ...


class ForwardContext:
    def __init__(
        self,
        cfg: ModelConfig,
        pool: KVPool,
        freqs: dict[str, torch.Tensor],
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        key_slots: torch.Tensor,
        key_pos: torch.Tensor,
        observer: LayerObserver | None = None,
        shift: KVShift | None = None,
        sequence_slots: torch.Tensor | None = None,
    ) -> None:
        """positions, write_slots: [B, T]; key_slots, key_pos: [B, S] (padding: slot 0, position NO_KEY).
        With a shift (one sequence): sequence_slots [blocks * block_size], the slot of each position of
        the sequence's whole block table (the shift reaches tokens past the chunk's last query)."""
        self.cfg = cfg
        self.pool = pool
        self.freqs = freqs
        self.positions = positions
        self.write_slots = write_slots
        self.key_slots = key_slots
        self.key_pos = key_pos
        self.observer = observer
        self.shift = shift
        self.sequence_slots = sequence_slots
        assert shift is None or (sequence_slots is not None and positions.shape[0] == 1)
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kind = self.cfg.layer_types[layer]
        if kind not in self._rope:
            self._rope[kind] = rope.cos_sin(self.positions, self.freqs[kind])
        return self._rope[kind]

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D], k, v: [B, T, Hkv, D] (after RoPE) -> [B, T, Hq, D]."""
        if self.observer is not None and layer in self.observer.layers:
            self.observer.observe(layer, self, q, k, v)
        if self.shift is not None:
            assert self.sequence_slots is not None
            kind = self.cfg.layer_types[layer]
            pool_k, pool_v, freq = self.pool.k[layer], self.pool.v[layer], self.freqs[kind]
            slots = self.sequence_slots
            self.shift.apply(layer, self.positions[0], slots, k[0], v[0], pool_k, pool_v, freq, kind)
        self.pool.write(layer, self.write_slots.flatten(), k.flatten(0, 1), v.flatten(0, 1))
        keys, values = self.pool.read(layer, self.key_slots)  # [B, S, Hkv, D]
        return attend(
            q,
            self.positions,
            keys,
            values,
            self.key_pos,
            scale=self.cfg.attn_scale,
            window=self.cfg.window(layer),
        )
