"""What a bench run measures: per-request records, the fidelity of a system's output against the full
prefill of the same request, and the summaries the report prints: per system, per turn, and per
setting and answer position (recall) with confidence intervals.

Definitions (docs/bench.md has the long form):
- KL: KL(full || system) of the next-token distributions at the first generated position, in nats.
- top-1: the argmax of both distributions is the same token; top-1 (sure): the same, over the
  requests whose full prefill led with its first token by at least SURE_MARGIN probability.
- KL ≤ 0.05: the share of requests whose KL is at most KL_CLOSE (the fidelity target's threshold).
- same N: the greedy continuations (up to N tokens, or EOS) are identical token for token; match:
  how many leading tokens they share, on average.
- computed: prompt tokens computed from scratch plus reused tokens recomputed by repair, over the
  prompt tokens; FLOPs: the system's estimated prefill FLOPs over the full prefill's.
- accuracy: one of the request's answers appears (case-insensitively) in the first non-empty line
  of the greedy continuation; for a request whose prompt ends where the answer begins (recall), the
  continuation must start with it, past leading spaces, as a whole word.
- peak KV: the most KV memory the system held while a request ran (see runner.py).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvsplice.bench.stats import Interval, paired_difference, wilson
from kvsplice.sampling import kl_divergence, top_margin

if TYPE_CHECKING:
    from kvsplice.bench.base import BenchRequest

# A request's next-token distribution this close to the full prefill's (nats) counts as faithful: the
# fidelity target asks that 95% of requests be within it.
KL_CLOSE = 0.05
# A full prefill whose first token leads the runner-up by this much probability is sure of it: below
# that, the full prefill is torn itself and repair's first tokens differ from it most (docs/design.md).
SURE_MARGIN = 0.2
# A group over every answer position (or every setting).
ALL = "all"
POSITIONS = ("first", "middle", "last")


@dataclass
class RequestRecord:
    """One request on one system."""

    system: str
    request_id: str
    warmup: bool = False
    group: str = ""
    turn: int = 0
    # The request's setting and answer position (recall), for the breakdown in the report.
    setting: str = ""
    answer_position: str = ""
    # Why the system failed on this request; None when it succeeded.
    error: str | None = None
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    segment_hit_tokens: int = 0
    # Of those, spliced from lead KV computed after the same prompt head (exact).
    segment_lead_tokens: int = 0
    # Reused KV of spans found without markup (auto_segments).
    discovered_hit_tokens: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0
    # Prefilled in full after repair left a near-tie (RequestOptions.repair_fallback_margin).
    fell_back: bool = False
    # Tokens computed after the first token to fill the segment store (missed segments, on their own).
    store_tokens: int = 0
    # Segment tokens loaded into the pool from a tier below it (disk, Redis), by tier, and the seconds
    # that took (read, verify, decode; part of the TTFT).
    store_hit_tokens: dict[str, int] = field(default_factory=dict)
    store_load_s: float = 0.0
    prefill_flops: float = 0.0
    # FLOPs the engine computed in the background while the request ran to idle (contexts, lead KV of
    # stored segments): the segment store's work for this request's documents.
    background_flops: float = 0.0
    ttft_s: float = 0.0
    kv_peak_bytes: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # Against the full prefill of the same request; None when there is none to compare with.
    kl: float | None = None
    top1: bool | None = None
    # The full prefill's own margin at the first generated position: its top token's probability minus
    # the runner-up's. Where it is small the full prefill itself is torn, and any perturbation may flip
    # its answer; top-1 agreement is also reported where it is at least SURE_MARGIN.
    reference_margin: float | None = None
    # The system's own margin there: what a system could gate a fallback on, since it knows its own
    # logits but not the full prefill's (bench/analyses/gate.py).
    margin: float | None = None
    same_continuation: bool | None = None
    # Leading tokens of the greedy continuation equal to the full prefill's.
    matched_tokens: int | None = None
    # The full prefill's estimated FLOPs for the same request.
    reference_flops: float | None = None
    ttft_speedup: float | None = None
    correct: bool | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def for_request(cls, system: str, request: BenchRequest) -> RequestRecord:
        """A record of `request` on `system` that carries the request's labels."""
        return cls(
            system,
            request.request_id,
            warmup=request.warmup,
            group=request.group,
            turn=request.turn,
            setting=request.setting,
            answer_position=request.answer_position,
        )


@dataclass(frozen=True)
class SystemSummary:
    """A system over the measured requests; rates and means are over the requests it completed."""

    system: str
    requests: int
    failed: int
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    # Median over requests of (full prefill's TTFT / this system's TTFT).
    speedup_p50: float | None = None
    computed_frac: float | None = None
    flops_frac: float | None = None
    # The same with the background work the requests left, over the full prefill's FLOPs.
    total_flops_frac: float | None = None
    prefix_hit_frac: float | None = None
    segment_hit_frac: float | None = None
    discovered_hit_frac: float | None = None
    recomputed_frac: float | None = None
    # Tokens computed after the first token to fill the segment store, over the prompt tokens.
    store_fill_frac: float | None = None
    # Prompt tokens loaded from each tier below the pool, over the prompt tokens (only tiers that
    # served any), and the mean seconds per request spent loading them.
    tier_hit_frac: dict[str, float] = field(default_factory=dict)
    store_load_mean_s: float | None = None
    kl_mean: float | None = None
    kl_p95: float | None = None
    # Share of the compared requests whose KL is at most KL_CLOSE.
    close_rate: float | None = None
    top1_rate: float | None = None
    same_rate: float | None = None
    # Mean leading tokens of the continuation equal to the full prefill's.
    matched_mean: float | None = None
    accuracy: float | None = None
    peak_kv_bytes: int | None = None


@dataclass(frozen=True)
class TurnSummary:
    """One system at one turn (chat) or step (agent), over the conversations or episodes."""

    turn: int
    system: str
    requests: int
    failed: int
    prompt_tokens_mean: float | None = None
    ttft_p50_s: float | None = None
    computed_mean: float | None = None
    reused_mean: float | None = None
    # First-token KL from the full prefill: mean and its standard error (None with fewer than 2).
    kl_mean: float | None = None
    kl_se: float | None = None
    top1_rate: float | None = None


@dataclass(frozen=True)
class GroupSummary:
    """One system over the measured requests of one setting and answer position. Accuracy carries its
    Wilson interval, and its paired difference from the full prefill on the same requests Newcombe's,
    which says whether a system loses accuracy, not only how much it seems to."""

    setting: str
    answer_position: str
    system: str
    requests: int
    failed: int
    # Accuracy with its 95% Wilson interval, over the requests the system completed.
    accuracy: Interval | None = None
    # The system's accuracy minus the full prefill's on the requests both completed (95% interval).
    accuracy_diff: Interval | None = None
    kl_mean: float | None = None
    # Share of the compared requests whose KL is at most KL_CLOSE.
    close_rate: float | None = None
    top1_rate: float | None = None
    # Top-1 agreement where the full prefill was sure of its first token (SURE_MARGIN), and over how
    # many requests.
    top1_sure_rate: float | None = None
    sure: int = 0
    # Mean leading tokens of the continuation equal to the full prefill's.
    matched_mean: float | None = None


# -- fidelity ------------------------------------------------------------------------------------------


def top1_agree(reference: torch.Tensor, logits: torch.Tensor) -> bool:
    return int(torch.argmax(reference)) == int(torch.argmax(logits))


def sure_top1(records: Iterable[RequestRecord]) -> tuple[float | None, int]:
    """Top-1 agreement over the compared records whose full prefill was sure of its first token
    (margin at least SURE_MARGIN), and how many those are."""
    sure = [r.top1 for r in records if r.top1 is not None and (r.reference_margin or 0.0) >= SURE_MARGIN]
    return (sum(sure) / len(sure) if sure else None), len(sure)


def first_line(text: str) -> str:
    return next((line for line in text.splitlines() if line.strip()), "")


def is_correct(text: str, answers: Iterable[str], at_start: bool = False) -> bool:
    """One of the answers is in the first non-empty line; with `at_start`, the continuation starts
    with it (past leading spaces) and it ends there or at a character that is not a letter or digit,
    so that "47210" is not "4721" and "Brenda" is not "Bren"."""
    if not at_start:
        line = first_line(text).lower()
        return any(answer.lower() in line for answer in answers)
    head = text.lstrip(" ").lower()
    return any(head.startswith(a.lower()) and not head[len(a) : len(a) + 1].isalnum() for a in answers if a)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two continuations share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linearly interpolated between order statistics; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(rank), math.ceil(rank)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def compare(
    record: RequestRecord, reference: RequestRecord, logits: torch.Tensor, ref_logits: torch.Tensor
) -> None:
    """Fill the record's fidelity fields against the full prefill of the same request."""
    record.kl = kl_divergence(ref_logits, logits)
    record.top1 = top1_agree(ref_logits, logits)
    record.reference_margin = top_margin(ref_logits)
    record.margin = top_margin(logits)
    record.same_continuation = record.token_ids == reference.token_ids
    record.matched_tokens = common_prefix(record.token_ids, reference.token_ids)
    record.reference_flops = reference.prefill_flops
    if record.ttft_s > 0:
        record.ttft_speedup = reference.ttft_s / record.ttft_s


# -- summaries -----------------------------------------------------------------------------------------


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _rate(flags: Iterable[bool | None]) -> float | None:
    known = [f for f in flags if f is not None]
    return sum(known) / len(known) if known else None


def close_rate(kls: Sequence[float]) -> float | None:
    """The share of KLs at most KL_CLOSE (None when nothing was compared)."""
    return sum(kl <= KL_CLOSE for kl in kls) / len(kls) if kls else None


def _frac(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarize(records: Sequence[RequestRecord], systems: Sequence[str]) -> list[SystemSummary]:
    """One summary per system, in the given order, over the measured (not warm-up) records."""
    by_system: dict[str, list[RequestRecord]] = defaultdict(list)
    for record in records:
        if not record.warmup:
            by_system[record.system].append(record)
    return [_summary(name, by_system[name]) for name in systems]


def _summary(name: str, records: list[RequestRecord]) -> SystemSummary:
    ok = [r for r in records if r.ok]
    failed = len(records) - len(ok)
    if not ok:
        return SystemSummary(name, len(records), failed)
    ttfts = [r.ttft_s for r in ok]
    prompt = sum(r.prompt_tokens for r in ok)
    compared = [r for r in ok if r.reference_flops]
    kls = [r.kl for r in ok if r.kl is not None]
    speedups = [r.ttft_speedup for r in ok if r.ttft_speedup is not None]
    return SystemSummary(
        system=name,
        requests=len(records),
        failed=failed,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p95_s=percentile(ttfts, 95),
        speedup_p50=percentile(speedups, 50),
        computed_frac=_frac(sum(r.computed_tokens + r.recomputed_tokens for r in ok), prompt),
        flops_frac=_frac(
            sum(r.prefill_flops for r in compared), sum(r.reference_flops or 0.0 for r in compared)
        ),
        total_flops_frac=_frac(
            sum(r.prefill_flops + r.background_flops for r in compared),
            sum(r.reference_flops or 0.0 for r in compared),
        ),
        prefix_hit_frac=_frac(sum(r.prefix_hit_tokens for r in ok), prompt),
        segment_hit_frac=_frac(sum(r.segment_hit_tokens for r in ok), prompt),
        discovered_hit_frac=_frac(sum(r.discovered_hit_tokens for r in ok), prompt),
        recomputed_frac=_frac(sum(r.recomputed_tokens for r in ok), prompt),
        store_fill_frac=_frac(sum(r.store_tokens for r in ok), prompt),
        tier_hit_frac=_tier_fracs(ok, prompt),
        store_load_mean_s=_mean([r.store_load_s for r in ok]),
        kl_mean=_mean(kls),
        kl_p95=percentile(kls, 95),
        close_rate=close_rate(kls),
        top1_rate=_rate(r.top1 for r in ok),
        same_rate=_rate(r.same_continuation for r in ok),
        matched_mean=_mean([r.matched_tokens for r in ok if r.matched_tokens is not None]),
        accuracy=_rate(r.correct for r in ok),
        peak_kv_bytes=max(r.kv_peak_bytes for r in ok),
    )


def _tier_fracs(records: Sequence[RequestRecord], prompt: int) -> dict[str, float]:
    tokens: dict[str, int] = defaultdict(int)
    for r in records:
        for tier, n in r.store_hit_tokens.items():
            tokens[tier] += n
    return {tier: n / prompt for tier, n in sorted(tokens.items())}


def per_turn(records: Sequence[RequestRecord], systems: Sequence[str]) -> list[TurnSummary]:
    """One row per (turn, system) over the measured records, turns in order."""
    cells: dict[tuple[int, str], list[RequestRecord]] = defaultdict(list)
    for record in records:
        if not record.warmup:
            cells[(record.turn, record.system)].append(record)
    rows = []
    for turn in sorted({t for t, _ in cells}):
        for name in systems:
            cell = cells.get((turn, name), [])
            ok = [r for r in cell if r.ok]
            rows.append(
                TurnSummary(
                    turn=turn,
                    system=name,
                    requests=len(cell),
                    failed=len(cell) - len(ok),
                    prompt_tokens_mean=_mean([r.prompt_tokens for r in ok]),
                    ttft_p50_s=percentile([r.ttft_s for r in ok], 50),
                    computed_mean=_mean([r.computed_tokens + r.recomputed_tokens for r in ok]),
                    reused_mean=_mean(
                        [r.prefix_hit_tokens + r.segment_hit_tokens + r.discovered_hit_tokens for r in ok]
                    ),
                    kl_mean=_mean(kls := [r.kl for r in ok if r.kl is not None]),
                    kl_se=statistics.stdev(kls) / math.sqrt(len(kls)) if len(kls) > 1 else None,
                    top1_rate=_rate(r.top1 for r in ok),
                )
            )
    return rows


def settings(records: Sequence[RequestRecord]) -> list[str]:
    """The settings of the measured records, in the order the run met them."""
    return list(dict.fromkeys(r.setting for r in records if r.setting and not r.warmup))


def by_group(records: Sequence[RequestRecord], systems: Sequence[str]) -> list[GroupSummary]:
    """Rows per setting (and over all settings when there are several), each for all positions and
    then for each position, a row per system; systems[0] is the reference."""
    measured = [r for r in records if r.setting and not r.warmup]
    names = settings(measured)
    groups = [*names, ALL] if len(names) > 1 else names
    present = [p for p in POSITIONS if any(r.answer_position == p for r in measured)]
    rows = []
    for setting in groups:
        for position in (ALL, *present):
            cell = [
                r for r in measured if setting in (ALL, r.setting) and position in (ALL, r.answer_position)
            ]
            reference = {r.request_id: r for r in cell if r.system == systems[0] and r.ok}
            for system in systems:
                rows.append(
                    _group(setting, position, system, [r for r in cell if r.system == system], reference)
                )
    return rows


def _group(
    setting: str,
    position: str,
    system: str,
    records: list[RequestRecord],
    reference: dict[str, RequestRecord],
) -> GroupSummary:
    ok = [r for r in records if r.ok]
    judged = [r.correct for r in ok if r.correct is not None]
    pairs = []
    for r in ok:
        ref = reference.get(r.request_id)
        if r.correct is not None and ref is not None and ref.correct is not None:
            pairs.append((r.correct, ref.correct))
    kls = [r.kl for r in ok if r.kl is not None]
    top1_sure, sure = sure_top1(ok)
    return GroupSummary(
        setting=setting,
        answer_position=position,
        system=system,
        requests=len(records),
        failed=len(records) - len(ok),
        accuracy=wilson(sum(judged), len(judged)),
        accuracy_diff=paired_difference(pairs),
        kl_mean=_mean(kls),
        close_rate=close_rate(kls),
        top1_rate=_rate(r.top1 for r in ok),
        top1_sure_rate=top1_sure,
        sure=sure,
        matched_mean=_mean([r.matched_tokens for r in ok if r.matched_tokens is not None]),
    )
