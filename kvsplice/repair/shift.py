"""Segment shift: the error its recomputed tokens show, moved onto a reused segment's other tokens.

A reused segment's stored KV was computed after other context than the prompt's, and on every layer
the error of its tokens' KV against a full prefill's has a part they share: in the keys (before
RoPE), 20 to 50% of the error's energy on SmolLM2's middle layers, in the values 10 to 17% (recall
bench, 8 documents). Repair recomputes some of the segment's tokens on every layer anyway, and each of
those shows its own error there (its new KV minus the moved KV its slot held). Their median, per
coordinate, estimates the shared part, and `shift` times it is added to the segment's tokens that are
not recomputed, on that layer, before its attention reads them: no FLOPs beyond the additions. The
median, not the mean, so that a few recomputed tokens whose error is far from the rest do not move
the others (held out, the two did alike: docs/fidelity.md). Less than the whole of it (`shift` < 1)
because the recomputed tokens are the ones the question reads most, not a random sample, and their
error is larger than the segment's typical one.

Applied once per layer and segment in each pass of a repair that recomputes spliced tokens, at the
first chunk of the pass that recomputes at least MIN_SAMPLE of the segment's tokens (with chunked
prefill a segment the chunk boundary cuts is estimated from its tokens in the first chunk only).
Keys are moved to position 0 for the median and back to each token's position for the shift.

Off by default (`repair_shift` = 0): at 0.5 on top of `lead@15` it brought Gemma 3 closer to a full
prefill on the recall bench, on every held-out seed, and SmolLM2 further from it (docs/fidelity.md).
Nor is it Gemma 3's default alone: its estimate depends on where chunks of the pass begin, and so a
request's logits on how the scheduler cut its prefill (max_num_batched_tokens, and the other
prefills of the step). With it at 0.5 as the default, tests/test_scheduler.py's chunk-size test failed
on a tiny Gemma 3 (logits apart by up to 0.18 between chunk sizes) for `deviation`, `query` and
`lead`: under concurrent traffic a request's answer would depend on what else runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvsplice.kv import rope

# Fewer recomputed tokens than this in a segment estimate its shared error too poorly to move the rest.
MIN_SAMPLE = 4


@dataclass
class SegmentShift:
    """The shift of one pass. `segments`: each reused segment's approximate positions (sorted; spans
    whose KV is exact, a lead KV or a cached prefix, are not listed). `fresh[layer]`: positions whose KV
    on that layer earlier passes of the repair recomputed; `own`: the pass's positions, which it
    recomputes (chunk by chunk). Both are left alone."""

    scale: float
    segments: Sequence[tuple[int, ...]]
    fresh: dict[int, frozenset[int]] = field(default_factory=dict)
    own: frozenset[int] = frozenset()
    _done: set[tuple[int, int]] = field(default_factory=set)
    _selections: dict[
        tuple[tuple[int, ...], frozenset[int]], list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]
    ] = field(default_factory=dict)

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
    ) -> None:
        """Before a chunk's new K/V are written on `layer`: shift the segments this chunk recomputes.
        positions: [T] the chunk's queries; key_slots: [S] the sequence's slot of each position
        (position order, every position of the segments); k, v: [T, Hkv, D] the queries' new K/V
        (after RoPE); pool_k, pool_v: the layer's pool tensors [slots, Hkv, D], shifted in place."""
        if self.scale == 0:
            return
        skip = self.fresh.get(layer, frozenset())
        for s, rows, at, to in self._selection(tuple(positions.tolist()), skip, k.device):
            if (layer, s) in self._done:
                continue
            self._done.add((layer, s))
            if not len(to):
                continue
            slots = key_slots[at]
            # Keys at position 0 ([n, Hkv, D]): the error shared across positions is there, not after RoPE.
            new_k = rope.rotate_by(k[rows].float(), -at, freq)
            old_k = rope.rotate_by(pool_k[slots].float(), -at, freq)
            dk = torch.quantile(new_k - old_k, 0.5, dim=0)  # [Hkv, D]
            dv = torch.quantile(v[rows].float() - pool_v[slots].float(), 0.5, dim=0)
            targets = key_slots[to]
            moved = rope.rotate_by(dk.expand(len(to), -1, -1).contiguous(), to, freq)  # [r, Hkv, D]
            pool_k[targets] = (pool_k[targets].float() + self.scale * moved).to(pool_k.dtype)
            pool_v[targets] = (pool_v[targets].float() + self.scale * dv).to(pool_v.dtype)

    def _selection(
        self, chunk: tuple[int, ...], skip: frozenset[int], device: torch.device
    ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per segment with at least MIN_SAMPLE of its tokens in the chunk: its index, those tokens' rows
        in the chunk and their positions, and the positions to shift. The same for every layer of a
        chunk (and of a pass, bar `skip`), so computed once."""
        key = (chunk, skip)
        found = self._selections.get(key)
        if found is None:
            index = {p: i for i, p in enumerate(chunk)}
            found = []
            for s, segment in enumerate(self.segments):
                sample = [p for p in segment if p in index]
                if len(sample) < MIN_SAMPLE:
                    continue
                rest = [p for p in segment if p not in index and p not in self.own and p not in skip]
                found.append(
                    (
                        s,
                        torch.tensor([index[p] for p in sample], device=device),
                        torch.tensor(sample, device=device),
                        torch.tensor(rest, dtype=torch.int64, device=device),
                    )
                )
            self._selections[key] = found
        return found
