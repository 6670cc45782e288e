"""The repair-policy interface. A policy picks which reused (spliced) tokens to recompute; it returns
positions and never touches the KV itself: the runner does the work."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvsplice.planner import Plan


@dataclass(frozen=True)
class RepairDecision:
    """Spliced positions to recompute on every layer, or, when `probe_layers` is set, the candidates
    computed on those layers only; after them the policy's `choose` keeps some of the candidates
    (ranked by how far their new K/V deviate from the reused K/V) for the remaining layers."""

    recompute: tuple[int, ...]
    probe_layers: tuple[int, ...] = ()


class RepairPolicy(ABC):
    name: ClassVar[str]
    # Whether the policy always leaves exact KV (recomputes every reused token).
    exact: ClassVar[bool] = False

    @abstractmethod
    def decide(self, plan: Plan, budget: int, num_layers: int) -> RepairDecision:
        """Which of plan's spliced positions to recompute, at most `budget` of them (after probing)."""

    def choose(self, deviation: dict[int, torch.Tensor], budget: int) -> torch.Tensor:
        """For probing policies: deviation[layer]: [C], one per candidate -> indices of at most
        `budget` candidates."""
        raise NotImplementedError(f"{self.name} does not probe")


def top_deviation(deviation: dict[int, torch.Tensor], budget: int) -> torch.Tensor:
    """The `budget` candidates whose K/V moved the most, summed over the probed layers, in position order."""
    score = torch.stack(list(deviation.values())).sum(0)
    k = min(budget, score.shape[0])
    return torch.topk(score, k).indices.sort().values
