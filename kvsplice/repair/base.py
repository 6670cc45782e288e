"""The repair-policy interface. A policy picks which reused (spliced) tokens to recompute; it returns
positions and never writes KV: the runner does the work.

A policy decides either at once, from the plan alone (`RepairDecision.recompute`), or after a probe:
the runner first computes the probe's positions (with every computed token) through layers
0..`last_layer` while the policy's `LayerObserver` watches them; then `choose` picks, from what it
saw, at most `budget` spliced positions to recompute. With `resume`, the chosen (a subset of the
probed) continue through the remaining layers from where the probe left them (CacheBlend's selection
by KV deviation); without, the chosen run the probe's layers from the first one, then they and the
computed tokens continue from there (a probe of the question's attention, which recomputes no
spliced token itself: the computed tokens' first layers saw the chosen tokens' unrepaired KV).

After a pass through every layer a policy may `refine`: from the next-token logits that pass gave, ask
for more spliced positions to recompute (with the computed tokens, from the first layer), round after
round, until it returns None (the adaptive policy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsplice.kv.context import LayerObserver
from kvsplice.model_config import ModelConfig
from kvsplice.plan import Plan


@dataclass(frozen=True)
class RepairTask:
    plan: Plan
    # At most this many spliced tokens may be recomputed (after a probe, at most this many continue).
    budget: int
    num_layers: int
    # The model, for policies whose choice depends on its layers (None in model-free tests).
    model: ModelConfig | None = None
    # The segment shift's scale (repair/shift.py); 0: none.
    shift: float = 0.0
    # After the policy is done: below this first-token margin, recompute every stale token (RepairRun).
    fallback_margin: float = 0.0
    # Prefix positions whose KV an earlier request spliced (a prefix hit under segment keys) and that
    # lie in blocks the request owns: a fallback recomputes them too, so that its result is exact.
    inherited: tuple[int, ...] = ()


@dataclass(frozen=True)
class Probe:
    # Spliced positions computed on layers 0..last_layer, alongside every computed token.
    positions: tuple[int, ...]
    last_layer: int
    # Watches the probe's layers.
    observer: LayerObserver
    # The chosen tokens and the computed ones resume from the probe's hidden states after last_layer
    # (the chosen must then be among the probed positions); else the chosen first run layers
    # 0..last_layer, and then both resume (a probe through every layer: both start again from layer 0).
    resume: bool = True


@dataclass(frozen=True)
class RepairDecision:
    """Spliced positions to recompute on every layer, or a probe whose outcome `choose` decides."""

    recompute: tuple[int, ...] = ()
    probe: Probe | None = None

    def __post_init__(self) -> None:
        assert not (self.recompute and self.probe), "a decision recomputes or probes, not both"


class RepairPolicy(ABC):
    name: ClassVar[str]
    # Whether the policy always leaves exact KV (recomputes every reused token).
    exact: ClassVar[bool] = False
    # Whether the request's budget (ratio or tokens) bounds the policy; else it may recompute every
    # reused token and stops by its quality target.
    budgeted: ClassVar[bool] = True

    @abstractmethod
    def decide(self, task: RepairTask) -> RepairDecision:
        """Which of the plan's spliced positions to recompute (at most task.budget), or what to probe."""

    def choose(self, task: RepairTask, probe: Probe, logits: torch.Tensor | None) -> tuple[int, ...]:
        """After the probe pass: at most task.budget of probe.positions, sorted, to finish computing.
        `logits`: the last token's next-token logits [vocab] if the probe ran through every layer."""
        raise NotImplementedError(f"{self.name} does not probe")

    def refine(self, task: RepairTask, logits: torch.Tensor) -> tuple[int, ...] | None:
        """After a pass through every layer that gave `logits` [vocab]: more spliced positions (sorted)
        to recompute from the first layer, or None: the repair is done."""
        return None


def probe_unless_settled(task: RepairTask, probe: Callable[[tuple[int, ...]], Probe]) -> RepairDecision:
    """A probing policy's decision: nothing where no token is stale (plan.stale()) or the budget is 0,
    every stale token where the budget covers them all (no probe could choose otherwise), else
    `probe(stale)`."""
    stale = tuple(task.plan.stale())
    if not stale or task.budget <= 0:
        return RepairDecision()
    if task.budget >= len(stale):
        return RepairDecision(stale)
    return RepairDecision(probe=probe(stale))
