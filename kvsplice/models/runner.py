"""The model runner: executes one forward pass over the KV pool, layer by layer.

Two entry points, both built on the same context and the same attention primitive:
`prefill` runs one sequence's query tokens (a whole prompt, the part after a cached prefix, or a
scattered set of tokens to repair), `decode` runs one new token for each of a batch of sequences.
Only the logits of each sequence's last token are computed: the LM head of a large vocabulary
(Gemma 3: 262,144 x 640) would otherwise dominate prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvsplice.kv import rope
from kvsplice.kv.attention import NO_KEY
from kvsplice.kv.context import ForwardContext
from kvsplice.kv.pool import KVPool
from kvsplice.models.layers import CausalLM


@dataclass(frozen=True)
class Narrowing:
    """Sparse repair driven by the model's own signal (CacheBlend): on the layers `probe_layers`,
    every candidate query is computed and its K/V deviation from the cached K/V is measured; after
    the last probe layer `choose(deviation)` returns which candidates (indices into `candidates`)
    keep being computed on the remaining layers. Non-candidate queries are always computed."""

    probe_layers: tuple[int, ...]
    candidates: torch.Tensor  # [C] indices into the query tokens
    choose: Callable[[dict[int, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class DecodeItem:
    block_table: list[int]
    token_id: int
    position: int


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        self.model = model
        self.cfg = model.cfg
        self.pool = pool
        self.device = pool.device
        # Multiply-adds of one token through one layer's projections and MLP, for FLOP accounting.
        first = model.layers[0]
        self._layer_macs = sum(p.numel() for name, p in first.named_parameters() if p.dim() == 2)
        # Estimated FLOPs of the last forward pass (projections, MLP, attention scores and mixing, LM head).
        self.last_flops = 0.0
        self.freqs = {
            kind: rope.inv_freq(spec, self.cfg.head_dim).to(self.device)
            for kind, spec in self.cfg.rope.items()
        }

    @torch.inference_mode()
    def prefill(
        self,
        block_table: list[int],
        token_ids: list[int],
        query_positions: list[int],
        narrowing: Narrowing | None = None,
        need_logits: bool = True,
    ) -> torch.Tensor | None:
        """Compute the tokens at `query_positions` (sorted) of a sequence whose keys are
        token_ids[:n] with n = query_positions[-1] + 1; every other position < n must already
        hold valid KV in the pool. Returns the float32 logits [vocab] of the last position."""
        n = query_positions[-1] + 1
        positions = torch.tensor(query_positions, dtype=torch.int64, device=self.device)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)[positions]
        ctx = self._context([block_table], positions[None], [n])
        logits = self._forward(ids[None], ctx, narrowing, need_logits)
        return None if logits is None else logits[0]

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One token per sequence, written at its position. Returns float32 logits [B, vocab]."""
        positions = torch.tensor([[it.position] for it in items], dtype=torch.int64, device=self.device)
        ids = torch.tensor([[it.token_id] for it in items], dtype=torch.int64, device=self.device)
        ctx = self._context([it.block_table for it in items], positions, [it.position + 1 for it in items])
        logits = self._forward(ids, ctx, None, True)
        assert logits is not None
        return logits

    def _context(
        self, tables: list[list[int]], positions: torch.Tensor, lengths: list[int]
    ) -> ForwardContext:
        bs = self.pool.block_size
        num_blocks = max(-(-n // bs) for n in lengths)
        # Keys are read block by block (each block's slots are contiguous, and in position order).
        key_blocks = torch.tensor(
            [
                t[: -(-n // bs)] + [0] * (num_blocks - -(-n // bs))
                for t, n in zip(tables, lengths, strict=True)
            ],
            dtype=torch.int64,
            device=self.device,
        )  # [B, nb]
        key_slots = (key_blocks[:, :, None] * bs + torch.arange(bs, device=self.device)).flatten(
            1
        )  # [B, nb*bs]
        key_pos = torch.arange(num_blocks * bs, device=self.device).expand(len(tables), -1)
        lengths_t = torch.tensor(lengths, device=self.device)[:, None]
        key_pos = torch.where(key_pos < lengths_t, key_pos, torch.full_like(key_pos, NO_KEY))
        write_slots = torch.stack([self.pool.slots(t, p) for t, p in zip(tables, positions, strict=True)])
        return ForwardContext(self.cfg, self.pool, self.freqs, positions, write_slots, key_slots, key_pos)

    def _forward(
        self, ids: torch.Tensor, ctx: ForwardContext, narrowing: Narrowing | None, need_logits: bool
    ) -> torch.Tensor | None:
        h = self.model.embed(ids)  # [B, T, hidden]
        last_probe = -1
        if narrowing is not None:
            for probed in narrowing.probe_layers:
                ctx.probe[probed] = narrowing.candidates
            last_probe = max(narrowing.probe_layers)
        self.last_flops = 0.0
        for i, layer in enumerate(self.model.layers):
            self.last_flops += self._flops(ctx.positions, i)
            h = layer(h, ctx)
            if i == last_probe:
                assert narrowing is not None
                kept = narrowing.candidates[narrowing.choose(ctx.deviation)]
                keep = torch.ones(h.shape[1], dtype=torch.bool, device=h.device)
                keep[narrowing.candidates] = False
                keep[kept] = True
                index = keep.nonzero().squeeze(1)
                h = h[:, index]
                ctx.keep(index)
        if not need_logits:
            return None
        self.last_flops += 2.0 * h.shape[0] * self.cfg.hidden_size * self.cfg.vocab_size
        return self.model.logits(h[:, -1])  # [B, vocab]

    def _flops(self, positions: torch.Tensor, layer: int) -> float:
        window = self.cfg.window(layer)
        visible = positions + 1 if window is None else (positions + 1).clamp(max=window)
        attention = 4.0 * self.cfg.num_heads * self.cfg.head_dim * float(visible.sum())
        return 2.0 * positions.numel() * self._layer_macs + attention
