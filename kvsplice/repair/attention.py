"""Query-aware repair: the prompt's question decides which reused tokens are worth recomputing.

The tokens after the last reused segment (the question, the answer prefix) are what the answer is
computed from. A probe pass computes every computed token (not one reused token) through the layers
up to one global-attention layer a quarter of the way in (`probe_layers`), over the moved, unrepaired
KV, and watches how much attention the question's tokens pay to each reused token there. The reused tokens
they attend to most are recomputed through every layer, with the question (which must see their
repaired KV from the first layer on: resumed from the probe, it answered much further from a full
prefill). The other computed tokens (the instruction, separators, documents new to the store) resume
from the probe's hidden states, so they run each layer once: those after a chosen token saw its KV
unrepaired in the probe's layers, which measured as no loss and saves the probe's layers for every
new document (docs/design.md). On a warm request, where little is computed but the question, the
probe costs its layers for the question.
The question sees every reused token in the probe because the global layers have no window (on a
sliding-window layer it would see only the last `window`).
"""

from __future__ import annotations

import torch

from kvsplice.kv.context import ForwardContext
from kvsplice.model_config import ModelConfig
from kvsplice.plan import Plan
from kvsplice.repair.base import Probe, RepairDecision, RepairPolicy, RepairTask, probe_unless_settled


class QueryAttentionObserver:
    """Sums, per key position, the attention probability the watched queries give it."""

    def __init__(self, queries: tuple[int, ...], layers: frozenset[int], length: int, scale: float) -> None:
        self.layers = layers
        self.scale = scale
        self.score = torch.zeros(length)  # [prompt tokens]
        self._watched = torch.zeros(length, dtype=torch.bool)
        self._watched[list(queries)] = True

    def observe(
        self, layer: int, ctx: ForwardContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """q, k: [1, T, Hq|Hkv, D] after RoPE; k is not written yet, so the chunk's own keys are taken from
        it and every earlier key from the pool: the scores do not depend on how the pass is chunked."""
        positions = ctx.positions[0]
        rows = self._watched[positions.cpu()].nonzero().squeeze(1).to(q.device)
        if rows.numel() == 0:
            return
        n = int(positions[-1]) + 1
        # Keys are laid out by position (models/runner.py): key index p holds position p.
        keys, _ = ctx.pool.read(layer, ctx.key_slots[0, :n])  # [n, Hkv, D]
        keys = keys.to(q.dtype).clone()
        keys[positions] = k[0]
        queries = q[0, rows]  # [Tq, Hq, D]
        group = queries.shape[1] // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1)  # [n, Hq, D]
        logits = torch.einsum("thd,shd->hts", queries, keys) * self.scale  # [Hq, Tq, n]
        visible = torch.arange(n, device=q.device)[None, :] <= positions[rows][:, None]  # [Tq, n]
        mass = logits.masked_fill(~visible, float("-inf")).softmax(dim=-1).sum(dim=(0, 1))  # [n]
        self.score[:n] += mass.float().cpu()


# The probe watches the first global-attention layer at or past this share of the model's depth.
# Early layers attend by position more than by content: on a model without sliding windows, where
# every layer is global, watching layers 0-1 ranked poorly (docs/design.md).
PROBE_DEPTH = 0.25


def probe_layers(cfg: ModelConfig) -> frozenset[int]:
    """The layer whose attention the probe watches: the first global-attention layer at or past
    PROBE_DEPTH of the depth (the last layer if none is)."""
    depth = PROBE_DEPTH * (cfg.num_layers - 1)
    deep = [i for i in range(cfg.num_layers) if cfg.window(i) is None and i >= depth]
    return frozenset({deep[0] if deep else cfg.num_layers - 1})


def question_probe(task: RepairTask, last_layer: int) -> Probe:
    """A probe of the question's attention (plan.question()) to the reused tokens on the probe layers:
    the computed tokens run through layers 0..last_layer (recomputing no reused token), the question's
    attention is summed, and the question starts again from the first layer afterwards."""
    plan = task.plan
    assert task.model is not None, "probing the question needs the model's layer types"
    question = plan.question()
    layers = probe_layers(task.model)
    observer = QueryAttentionObserver(question, layers, plan.num_tokens, task.model.attn_scale)
    return Probe((), last_layer, observer, resume=False)


# The first segment takes at most this share of the budget: at 4 documents it is a quarter of the
# prompt and would take all of it, leaving the answer's document unrepaired wherever else it is.
FIRST_SEGMENT_SHARE = 0.5


class AttentionRepair(RepairPolicy):
    """Recompute the reused tokens the question attends to most, the prompt's first reused segment first
    (at most `FIRST_SEGMENT_SHARE` of the budget). The default policy (EngineConfig.repair).

    A probe runs the computed tokens (no reused one) through the first layers up to the probe layer
    over the moved, unrepaired KV and sums the attention the question pays each reused token there.
    In place the first reused segment follows only the start of the prompt, while its stored KV was
    computed after other content, so the damage concentrates there; within it the question's attention
    ranks too. Only the prompt's first segment leads: where the prefix cache gave it, or it is spliced
    from lead KV computed after the same head (a full prefill's KV), the question alone ranks.
    docs/design.md gives the measurements that chose it."""

    name = "attention"

    def decide(self, task: RepairTask) -> RepairDecision:
        def probe(stale: tuple[int, ...]) -> Probe:
            assert task.model is not None, "the lead policy needs the model's layer types"
            return question_probe(task, max(probe_layers(task.model)))

        return probe_unless_settled(task, probe)

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        assert isinstance(probe.observer, QueryAttentionObserver)
        return attention_choice(task.plan, probe.observer.score, task.budget)


def attention_choice(plan: Plan, score: torch.Tensor, budget: int) -> tuple[int, ...]:
    """`lead`'s choice of `budget` spliced positions (sorted) from the question's attention `score`
    [prompt tokens]. Nested: the choice at a budget holds the choice at every smaller one (the first
    segment's share, budget // 2, only grows; the rest are the best remaining by score)."""
    score = score.clone()
    first = plan.spliced()[0]
    if first.segment == 0 and not first.lead_kv:
        part = score[first.start : first.end]
        lead = part.topk(min(len(part), int(FIRST_SEGMENT_SHARE * budget))).indices + first.start
        # Above every other token (attention mass is finite and >= 0), in the question's order.
        score[lead] += score.max() + 1
    return most_attended(plan, score, budget)


def most_attended(plan: Plan, score: torch.Tensor, budget: int) -> tuple[int, ...]:
    """The `budget` stale spliced positions (sorted) with the highest `score` [prompt tokens]. Never a
    token spliced from lead KV computed after the same head: the question attends to the prompt's first
    segment much, and its exact KV would only be computed again (plan.stale())."""
    stale = torch.tensor(plan.stale(), dtype=torch.long)
    top = torch.topk(score[stale], min(budget, len(stale))).indices
    return tuple(sorted(stale[top].tolist()))
