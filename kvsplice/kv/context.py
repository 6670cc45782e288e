"""One forward pass's view of the KV pool: where its queries write and which keys they read.

The model's layers call `ctx.rope(layer)` for the cos/sin of their queries' positions and
`ctx.attention(layer, q, k, v)`, which writes the queries' own K/V into their slots first and then
attends over every key of each sequence through the one attention primitive. The runner may narrow
the set of query tokens between layers (sparse repair), which is why positions and slots live here
and not in the model.
"""

from __future__ import annotations

import torch

from kvsplice.kv import rope
from kvsplice.kv.attention import attend
from kvsplice.kv.pool import KVPool
from kvsplice.models.config import ModelConfig


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
    ) -> None:
        """positions, write_slots: [B, T]; key_slots, key_pos: [B, S] (padding: slot 0, position NO_KEY)."""
        self.cfg = cfg
        self.pool = pool
        self.freqs = freqs
        self.positions = positions
        self.write_slots = write_slots
        self.key_slots = key_slots
        self.key_pos = key_pos
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # Layers on which to measure how far the new K/V of some queries deviate from what the
        # pool held in their slots before (CacheBlend's selection signal): layer -> query indices.
        self.probe: dict[int, torch.Tensor] = {}
        self.deviation: dict[int, torch.Tensor] = {}

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kind = self.cfg.layer_types[layer]
        if kind not in self._rope:
            self._rope[kind] = rope.cos_sin(self.positions, self.freqs[kind])
        return self._rope[kind]

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, T, Hq, D], k, v: [B, T, Hkv, D] (after RoPE) -> [B, T, Hq, D]."""
        slots = self.write_slots.flatten()
        k_flat, v_flat = k.flatten(0, 1), v.flatten(0, 1)  # [B*T, Hkv, D]
        if layer in self.probe:
            index = self.probe[layer]
            old_k, old_v = self.pool.read(layer, slots[index])
            k_dev = (k_flat[index] - old_k.to(k.dtype)).square().sum(dim=(-2, -1))
            v_dev = (v_flat[index] - old_v.to(v.dtype)).square().sum(dim=(-2, -1))
            self.deviation[layer] = k_dev + v_dev
        self.pool.write(layer, slots, k_flat, v_flat)
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

    def keep(self, index: torch.Tensor) -> None:
        """Narrow the queries of a single sequence to `index` ([T'] sorted indices into its T tokens)."""
        assert self.positions.shape[0] == 1, "narrowing queries is for one sequence at a time"
        self.positions = self.positions[:, index]
        self.write_slots = self.write_slots[:, index]
        self._rope = {kind: (c[:, index], s[:, index]) for kind, (c, s) in self._rope.items()}
