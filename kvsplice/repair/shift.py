"""Segment shift: the error its recomputed tokens show, moved onto a reused segment's other tokens.

A reused segment's stored KV was computed after other context than the prompt's, and on every layer
the error of its tokens' KV against a full prefill's has a part they share, in the keys (before
RoPE) more than in the values (docs/design.md). Repair recomputes some of the segment's tokens on
every layer anyway, and each of those shows its own error there (its new KV minus the moved KV its
slot held). Their median, per coordinate, estimates the shared part, and `shift` times it is added
to the segment's tokens that are not recomputed, on that layer, before its attention reads them: no
FLOPs beyond the additions. The median, not the mean, so that a few recomputed tokens whose error is
far from the rest do not move the others (held out, the two did alike: docs/fidelity.md). Less than
the whole of it (`shift` < 1) because the recomputed tokens are the ones the question reads most,
not a random sample, and their error is larger than the segment's typical one.

Applied once per layer and segment in each pass of a repair that recomputes spliced tokens, to the
segments of which the pass recomputes at least MIN_SAMPLE tokens (its sample), in the chunk that
holds the sample: a chunk of such a pass never cuts a sample (`whole`, reuse/work.py), so the estimate
is the same however the scheduler cuts the prefill. Cut at any token, it came from the part of the
sample in the first chunk, and a request's logits depended on `max_num_batched_tokens` and on the
other prefills of each step. Keys are moved to position 0 for the median and back to each token's
position for the shift.

Its default depends on the model family (`default_shift`): at 0.5 on top of `attention@15` it brought
Gemma 3 closer to a full prefill on the recall bench, on every held-out seed, and SmolLM2 further
from it (docs/design.md gives the numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvsplice.kv import rope
from kvsplice.model_config import ModelConfig

# The segment shift per model family (config.json's architecture), where measurement chose one; 0
# elsewhere. On Gemma 3 it brought the recall bench closer to a full prefill on every held-out seed, at
# the same accuracy; on SmolLM2 (Llama) it went further, so the Llama family stays at 0 (docs/design.md).
FAMILY_SHIFT = {"Gemma3ForCausalLM": 0.5}


def default_shift(cfg: ModelConfig) -> float:
    """The segment shift a model's engine repairs with unless told otherwise (EngineConfig.repair_shift)."""
    return FAMILY_SHIFT.get(cfg.architecture, 0.0)


# Fewer recomputed tokens than this in a segment estimate its shared error too poorly to move the rest.
MIN_SAMPLE = 4


@dataclass
class SegmentShift:
    """The shift of one pass. `segments`: each reused segment's approximate positions (sorted; spans
    whose KV is exact, a lead KV or a cached prefix, are not listed). `own`: the pass's positions, which
    it recomputes (chunk by chunk); `fresh[layer]`: positions whose KV on that layer earlier passes of
    the repair recomputed. Both are left alone."""

    scale: float
    segments: Sequence[tuple[int, ...]]
    own: frozenset[int]
    fresh: dict[int, frozenset[int]]
    _done: set[tuple[int, int]] = field(default_factory=set)
    _shifted: dict[int, list[int]] | None = None
    _selections: dict[tuple[tuple[int, ...], frozenset[int]], list[_Sample]] = field(default_factory=dict)

    def whole(self) -> list[tuple[int, int]]:
        """The first and last position of each sample the pass's chunks must not cut: a segment's
        recomputed tokens, where they are enough to estimate from and some layer of the pass has tokens
        of the segment to shift."""
        return [(sample[0], sample[-1]) for sample in self._samples().values()]

    def _samples(self) -> dict[int, list[int]]:
        """Each shifted segment's index and sample (the pass's tokens in it), where it has MIN_SAMPLE of
        them and some layer of the pass leaves tokens of it to shift."""
        if self._shifted is None:
            self._shifted = {}
            for s, segment in enumerate(self.segments):
                sample = [p for p in segment if p in self.own]
                rest = set(segment) - self.own
                if len(sample) >= MIN_SAMPLE and any(rest - fresh for fresh in self.fresh.values()):
                    self._shifted[s] = sample
        return self._shifted

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
    ) -> None:
        """Before a chunk's new K/V are written on `layer`: shift the segments whose sample this chunk
        recomputes. positions: [T] the chunk's queries; key_slots: [S] the sequence's slot of each
        position (position order, every position of the segments); k, v: [T, Hkv, D] the queries' new
        K/V (after RoPE); pool_k, pool_v: the layer's pool tensors [slots, Hkv, D], shifted in place;
        freq: the layer's RoPE inverse frequencies, the same for every layer of `rope_kind`."""
        if self.scale == 0:
            return
        skip = self.fresh[layer]
        for sample in self._selection(tuple(positions.tolist()), skip, k.device):
            if (layer, sample.segment) in self._done:
                continue
            self._done.add((layer, sample.segment))
            if not len(sample.to):
                continue
            back, forth = sample.angles(rope_kind, freq)
            slots = key_slots[sample.at]
            # The keys' error at position 0 ([n, Hkv, D]): the part shared across positions is there, not
            # after RoPE. Rotation is linear, so the difference is rotated once.
            error_k = rope.rotate(k[sample.rows].float() - pool_k[slots].float(), *back)
            dk = median(error_k)  # [Hkv, D]
            dv = median(v[sample.rows].float() - pool_v[slots].float())
            targets = key_slots[sample.to]
            moved = rope.rotate(dk.expand(len(sample.to), -1, -1), *forth)  # [r, Hkv, D]
            pool_k[targets] = (pool_k[targets].float() + self.scale * moved).to(pool_k.dtype)
            pool_v[targets] = (pool_v[targets].float() + self.scale * dv).to(pool_v.dtype)

    def _selection(self, chunk: tuple[int, ...], skip: frozenset[int], device: torch.device) -> list[_Sample]:
        """Per shifted segment whose sample is in the chunk (all of it): its sample's rows and positions,
        and the positions to shift. The same for every layer of a chunk (and of a pass, bar `skip`), so
        computed once."""
        key = (chunk, skip)
        found = self._selections.get(key)
        if found is None:
            index = {p: i for i, p in enumerate(chunk)}
            found = []
            for s, sample in self._samples().items():
                held = [p for p in sample if p in index]
                if not held:
                    continue
                assert len(held) == len(sample), "a chunk of a pass with the segment shift cuts no sample"
                rest = [p for p in self.segments[s] if p not in self.own and p not in skip]
                found.append(
                    _Sample(
                        s,
                        torch.tensor([index[p] for p in sample], device=device),
                        torch.tensor(sample, device=device),
                        torch.tensor(rest, dtype=torch.int64, device=device),
                    )
                )
            self._selections[key] = found
        return found


@dataclass
class _Sample:
    """One shifted segment in a chunk: `rows` [n] of its sample in the chunk, their positions `at` [n],
    and the positions `to` [r] its shift moves."""

    segment: int
    rows: torch.Tensor
    at: torch.Tensor
    to: torch.Tensor
    _angles: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )

    def angles(
        self, rope_kind: str, freq: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin ([n|r, D]) that move keys from `at` to position 0 and from 0 to `to`: computed
        once per RoPE kind, not per layer (they were a third of the shift's time)."""
        found = self._angles.get(rope_kind)
        if found is None:
            found = (rope.cos_sin(-self.at, freq), rope.cos_sin(self.to, freq))
            self._angles[rope_kind] = found
        return found


def median(x: torch.Tensor) -> torch.Tensor:
    """[n, ...] -> [...]: torch.quantile(x, 0.5, dim=0) (the mean of the two middle values where n is
    even), from the two middle order statistics along a contiguous last dimension: at the samples'
    sizes here (8 to 75 tokens) a quarter of quantile's time, which sorts."""
    n = x.shape[0]
    rows = x.reshape(n, -1).T.contiguous()  # [elements, n]
    low = rows.kthvalue((n + 1) // 2, dim=-1).values
    high = low if n % 2 else rows.kthvalue(n // 2 + 1, dim=-1).values
    return ((low + high) * 0.5).reshape(x.shape[1:])
