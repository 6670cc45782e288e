"""Repair policies by name."""

from __future__ import annotations

from kvsplice.repair.adaptive import AdaptiveRepair
from kvsplice.repair.attention import AttentionRepair
from kvsplice.repair.base import RepairPolicy
from kvsplice.repair.policies import BoundaryRepair, DeviationRepair, FullRepair, NoRepair

POLICIES: dict[str, type[RepairPolicy]] = {
    cls.name: cls
    for cls in (NoRepair, BoundaryRepair, DeviationRepair, AttentionRepair, AdaptiveRepair, FullRepair)
}
POLICY_NAMES = tuple(POLICIES)


def make_policy(name: str) -> RepairPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown repair policy {name!r}; choose one of {POLICY_NAMES}")
    return POLICIES[name]()


def budget_tokens(spliced: int, ratio: float) -> int:
    """The repair budget for `spliced` reused tokens: a rounded ratio of them."""
    return round(ratio * spliced)
