"""Repair policies by name."""

from __future__ import annotations

from kvsplice.model_config import ModelConfig
from kvsplice.repair.adaptive import AdaptiveRepair
from kvsplice.repair.base import RepairPolicy
from kvsplice.repair.margin import MarginRepair
from kvsplice.repair.policies import BoundaryRepair, DeviationRepair, FullRepair, NoRepair, RecencyRepair
from kvsplice.repair.query import LeadQueryRepair, QueryRepair

POLICIES: dict[str, type[RepairPolicy]] = {
    cls.name: cls
    for cls in (
        NoRepair,
        BoundaryRepair,
        DeviationRepair,
        RecencyRepair,
        QueryRepair,
        LeadQueryRepair,
        MarginRepair,
        AdaptiveRepair,
        FullRepair,
    )
}
POLICY_NAMES = tuple(POLICIES)


def make_policy(name: str) -> RepairPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown repair policy {name!r}; choose one of {POLICY_NAMES}")
    return POLICIES[name]()


def budget_tokens(spliced: int, ratio: float, tokens: int | None) -> int:
    """The repair budget for `spliced` reused tokens: an absolute count, or a rounded ratio."""
    return min(spliced, tokens if tokens is not None else round(ratio * spliced))


# The policy an engine repairs with where neither the request nor its config names one, by model family
# (ModelConfig.architecture); lead elsewhere. Measured on the recall evaluation (8 documents, each policy
# at its default budget against the other in the same run; bench/results/recall_margin): on SmolLM2
# (Llama) margin@12 against lead@15, held out, seed 18 (100 requests) KL 0.056 -> 0.026 (paired -0.031
# [-0.054, -0.015], lower on 81), within 0.05 73% -> 84%, first token 85% -> 90%, accuracy 59% -> 57%
# (full 62%), at 17.9% of a full prefill's FLOPs against 18.4%; seed 16 (60) 0.038 -> 0.021; 12
# documents, seed 17 (40) 0.047 -> 0.023. On Gemma 3 margin@15 was no
# closer than lead@15 (seeds 14 and 15, 100 requests) at more FLOPs, so lead stays there.
FAMILY_REPAIR = {"LlamaForCausalLM": MarginRepair.name}


def default_repair(cfg: ModelConfig) -> str:
    """The repair policy a model's engine runs unless told otherwise (EngineConfig.repair)."""
    return FAMILY_REPAIR.get(cfg.architecture, LeadQueryRepair.name)
