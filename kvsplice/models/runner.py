"""The model runner: executes forward passes over the KV pool, and returns what it computed.

Two entry points, both built on the same context and the same attention primitive:
`forward` runs query tokens of one sequence through a range of layers (a prefill chunk: part of a
prompt, the part after a cached prefix, a scattered set of tokens to repair, or a probe through the
first layers), `decode` runs one new token for each of a batch of sequences through every layer.
Only the logits of each sequence's last token are computed: the LM head of a large vocabulary
(Gemma 3: 262,144 x 640) would otherwise dominate prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsplice.kv import rope
from kvsplice.kv.attention import NO_KEY
from kvsplice.kv.context import ForwardContext, KVShift, LayerObserver
from kvsplice.kv.pool import KVPool
from kvsplice.models.flops import FlopModel
from kvsplice.models.layers import CausalLM


@dataclass(frozen=True)
class ForwardChunk:
    """Query tokens of one sequence through `layers`.

    Every position below positions[-1] that is not a query must already hold valid KV on these layers.
    `hidden` is the input of layers.start ([T, hidden]) when that is not the first layer."""

    block_table: Sequence[int]
    positions: Sequence[int]  # sorted
    token_ids: Sequence[int]  # the tokens at `positions`
    layers: range
    hidden: torch.Tensor | None = None
    need_logits: bool = False
    observer: LayerObserver | None = None
    # A repair pass's segment shift (repair/shift.py).
    shift: KVShift | None = None


@dataclass(frozen=True)
class ForwardResult:
    # float32 [vocab] for a chunk that asked for them, [B, vocab] for a decode batch.
    logits: torch.Tensor | None
    # The output of the chunk's last layer, [T, hidden], when that is not the model's last layer.
    hidden: torch.Tensor | None
    # Estimated FLOPs: projections, MLP, attention scores and mixing, LM head.
    flops: float


@dataclass(frozen=True)
class DecodeItem:
    block_table: Sequence[int]
    token_id: int
    position: int


class ModelRunner:
    def __init__(self, model: CausalLM, pool: KVPool) -> None:
        self.model = model
        self.cfg = model.cfg
        self.pool = pool
        self.device = pool.device
        self.flops = FlopModel(self.cfg)
        # The formula's projections are the model's: every matrix of a layer, counted once.
        macs = sum(p.numel() for p in model.layers[0].parameters() if p.dim() == 2)
        assert self.flops.layer_macs == macs, f"FLOP model: {self.flops.layer_macs} MACs, layer: {macs}"
        self.freqs = {
            kind: rope.inv_freq(spec, self.cfg.head_dim).to(self.device)
            for kind, spec in self.cfg.rope.items()
        }

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers

    @torch.inference_mode()
    def forward(self, chunk: ForwardChunk) -> ForwardResult:
        assert chunk.positions and len(chunk.positions) == len(chunk.token_ids)
        layers = chunk.layers
        assert 0 <= layers.start < layers.stop <= self.num_layers and layers.step == 1
        assert (chunk.hidden is None) == (layers.start == 0), "hidden states come in exactly past layer 0"
        assert not chunk.need_logits or layers.stop == self.num_layers
        positions = torch.tensor(chunk.positions, dtype=torch.int64, device=self.device)
        ctx = self._context(
            [chunk.block_table],
            positions[None],
            [chunk.positions[-1] + 1],
            chunk.observer,
            chunk.shift,
        )
        if chunk.hidden is None:
            ids = torch.tensor(chunk.token_ids, dtype=torch.int64, device=self.device)
            h = self.model.embed(ids[None])  # [1, T, hidden]
        else:
            h = chunk.hidden[None]
        dense = len(layers) * self.flops.dense(len(chunk.positions))
        attention = 0.0
        for i in layers:
            attention += self.flops.attention(ctx.positions, i)
            h = self.model.layers[i](h, ctx)
        if layers.stop < self.num_layers:
            return ForwardResult(None, h[0], dense + attention)
        if not chunk.need_logits:
            return ForwardResult(None, None, dense + attention)
        logits = self.model.logits(h[:, -1])[0]
        return ForwardResult(logits, None, dense + attention + self.flops.head(1))

    def prefill(
        self, block_table: Sequence[int], token_ids: Sequence[int], positions: Sequence[int]
    ) -> ForwardResult:
        """The queries at `positions` (sorted) of the sequence `token_ids` through every layer, with the
        logits of the last one: `forward` of a single chunk."""
        ids = [token_ids[p] for p in positions]
        return self.forward(
            ForwardChunk(block_table, positions, ids, range(self.num_layers), need_logits=True)
        )

    @torch.inference_mode()
    def decode(self, items: Sequence[DecodeItem]) -> ForwardResult:
        """One token per sequence, written at its position. Logits: float32 [B, vocab]."""
        positions = torch.tensor([[it.position] for it in items], dtype=torch.int64, device=self.device)
        ids = torch.tensor([[it.token_id] for it in items], dtype=torch.int64, device=self.device)
        ctx = self._context([it.block_table for it in items], positions, [it.position + 1 for it in items])
        h = self.model.embed(ids)  # [B, 1, hidden]
        flops = 0.0
        for i, layer in enumerate(self.model.layers):
            flops += self.flops.dense(len(items)) + self.flops.attention(ctx.positions, i)
            h = layer(h, ctx)
        return ForwardResult(self.model.logits(h[:, -1]), None, flops + self.flops.head(len(items)))

    def _context(
        self,
        tables: list[Sequence[int]],
        positions: torch.Tensor,
        lengths: list[int],
        observer: LayerObserver | None = None,
        shift: KVShift | None = None,
    ) -> ForwardContext:
        bs = self.pool.block_size
        num_blocks = max(-(-n // bs) for n in lengths)
        # Keys are read block by block (each block's slots are contiguous, and in position order).
        key_blocks = torch.tensor(
            [
                list(t[: -(-n // bs)]) + [0] * (num_blocks - -(-n // bs))
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
        write_slots = torch.stack(
            [self.pool.slots(list(t), p) for t, p in zip(tables, positions, strict=True)]
        )
        sequence_slots = None
        if shift is not None:
            (table,) = tables
            every = torch.arange(len(table) * bs, device=self.device)
            sequence_slots = self.pool.slots(list(table), every)
        return ForwardContext(
            self.cfg,
            self.pool,
            self.freqs,
            positions,
            write_slots,
            key_slots,
            key_pos,
            observer,
            shift,
            sequence_slots,
        )
