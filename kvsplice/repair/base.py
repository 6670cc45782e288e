"""The repair-policy interface. A policy picks which reused (spliced) tokens to recompute; it returns
positions and never writes KV: the runner does the work.

A policy decides either at once, from the plan alone (`RepairDecision.recompute`), or after a probe:
the runner first computes the probe's positions (with every computed token) through layers
0..`last_layer` while the policy's `LayerObserver` watches them; then `choose` picks, from what it
saw, at most `budget` spliced positions to recompute. With `resume`, the chosen (a subset of the
probed) continue through the remaining layers from where the probe left them (CacheBlend's selection
by KV deviation); without, they and the computed tokens run again from the first layer (a probe of
the question's attention, which recomputes no spliced token itself).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from kvsplice.kv.context import LayerObserver
from kvsplice.model_config import ModelConfig
from kvsplice.reuse.plan import Plan


@dataclass(frozen=True)
class RepairTask:
    plan: Plan
    # At most this many spliced tokens may be recomputed (after a probe, at most this many continue).
    budget: int
    num_layers: int
    # The model, for policies whose choice depends on its layers (None in model-free tests).
    model: ModelConfig | None = None


@dataclass(frozen=True)
class Probe:
    # Spliced positions computed on layers 0..last_layer, alongside every computed token.
    positions: tuple[int, ...]
    last_layer: int
    observer: LayerObserver
    # The chosen tokens and the computed ones resume from the probe's hidden states after last_layer
    # (the chosen must then be among the probed positions); else they start again from layer 0.
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

    @abstractmethod
    def decide(self, task: RepairTask) -> RepairDecision:
        """Which of the plan's spliced positions to recompute (at most task.budget), or what to probe."""

    def choose(self, task: RepairTask, probe: Probe) -> tuple[int, ...]:
        """After the probe pass: at most task.budget of probe.positions, sorted, to finish computing."""
        raise NotImplementedError(f"{self.name} does not probe")
