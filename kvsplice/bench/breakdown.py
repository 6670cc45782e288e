"""Accuracy and fidelity by setting and answer position (recall), each with its uncertainty: accuracy
with a Wilson interval, and the paired difference from the full prefill on the same requests with
Newcombe's interval, which says whether a system loses accuracy, not only how much it seems to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.bench.metrics import RequestRecord, close_rate, sure_top1
from kvsplice.bench.stats import Interval, paired_difference, wilson

# A group over every position (or every setting).
ALL = "all"
POSITIONS = ("first", "middle", "last")


@dataclass(frozen=True)
class GroupSummary:
    """One system over the measured requests of one setting and answer position."""

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
    # Share of the compared requests whose KL is at most metrics.KL_CLOSE.
    close_rate: float | None = None
    top1_rate: float | None = None
    # Top-1 agreement where the full prefill was sure of its first token (metrics.SURE_MARGIN), and
    # over how many requests.
    top1_sure_rate: float | None = None
    sure: int = 0
    # Mean leading tokens of the continuation equal to the full prefill's.
    matched_mean: float | None = None


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
                    _row(setting, position, system, [r for r in cell if r.system == system], reference)
                )
    return rows


def _row(
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
    top1 = [r.top1 for r in ok if r.top1 is not None]
    matched = [r.matched_tokens for r in ok if r.matched_tokens is not None]
    top1_sure, sure = sure_top1(ok)
    return GroupSummary(
        setting=setting,
        answer_position=position,
        system=system,
        requests=len(records),
        failed=len(records) - len(ok),
        accuracy=wilson(sum(judged), len(judged)),
        accuracy_diff=paired_difference(pairs),
        kl_mean=sum(kls) / len(kls) if kls else None,
        close_rate=close_rate(kls),
        top1_rate=sum(top1) / len(top1) if top1 else None,
        top1_sure_rate=top1_sure,
        sure=sure,
        matched_mean=sum(matched) / len(matched) if matched else None,
    )
