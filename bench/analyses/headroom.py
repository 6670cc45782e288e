"""What meeting the fidelity targets would cost a system: a lower bound on its prefill FLOPs.

The targets (issue 11's, on the recall evaluation, per setting): at least 95% of requests within a
next-token KL of 0.05 of the full prefill, first-token agreement of at least 98%, and accuracy at most
one point below the full prefill's. A system that misses them could still meet them by prefilling in
full the requests its repair gets wrong (a full prefill agrees with itself exactly). Even a policy
that knew in advance which those are would pay, per request it prefills in full, the full prefill's
FLOPs instead of the system's. The least it pays is bounded below, target by target: the target needs
m more requests fixed, only requests that miss it can fix it, so at least the m cheapest of those. The
largest of the three bounds is a lower bound on the whole (not always reached: the cheapest fixes of
one target need not fix the others).

So a row here says: with this repair, no splice-then-fall-back policy, however well it chose, meets
the targets for less than this share of the full prefill's FLOPs. A repair that needs more than the
budget (20%) here cannot be rescued by an adaptive fallback; it has to be better.

    python bench/analyses/headroom.py DIR [DIR ...]   prints the table for recorded runs
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsplice.bench.metrics import KL_CLOSE, RequestRecord, settings
from kvsplice.bench.results import BenchResult

Pair = tuple[RequestRecord, RequestRecord]


@dataclass(frozen=True)
class Targets:
    kl: float = KL_CLOSE
    close_share: float = 0.95  # of requests within `kl` of the full prefill
    top1: float = 0.98  # first-token agreement
    accuracy_drop: float = 0.01  # accuracy at least the full prefill's minus this

    def __post_init__(self) -> None:
        assert self.kl > 0 and 0 < self.close_share <= 1 and 0 < self.top1 <= 1 and self.accuracy_drop >= 0


@dataclass(frozen=True)
class Headroom:
    system: str
    setting: str
    requests: int
    # The system as it ran: shares of the requests.
    close_share: float
    top1: float
    # Its accuracy minus the full prefill's, in points (None where answers are not judged).
    accuracy_diff: float | None
    flops_share: float
    # At least this many requests must be prefilled in full to meet every target, and the FLOPs share
    # of the full prefill's that costs at least (the system's own when it meets them already).
    fallbacks: int
    flops_bound: float


def paired(records: Sequence[RequestRecord], reference: str) -> dict[tuple[str, str], list[Pair]]:
    """(system, full prefill) record pairs of the measured requests both ran and compared, per setting
    ("" for a run whose requests have none) and system other than `reference`."""
    measured = [r for r in records if not r.warmup and r.ok]
    groups: dict[tuple[str, str], list[Pair]] = {}
    for setting in settings(measured) or [""]:
        refs = {r.request_id: r for r in measured if r.setting == setting and r.system == reference}
        for r in measured:
            if r.setting == setting and r.system != reference and r.request_id in refs and r.kl is not None:
                groups.setdefault((setting, r.system), []).append((r, refs[r.request_id]))
    return groups


def headroom(
    records: Sequence[RequestRecord], reference: str, targets: Targets = Targets()
) -> list[Headroom]:
    """One row per setting (one for the run when its requests have none) and system compared with
    `reference` (the full prefill), over the measured requests both ran."""
    return [
        _row(system, setting, pairs, targets)
        for (setting, system), pairs in paired(records, reference).items()
        # (A run that recorded no FLOPs, a server's, has no cost to bound.)
        if all(ref.prefill_flops > 0 for _, ref in pairs)
    ]


def _row(system: str, setting: str, pairs: list[Pair], t: Targets) -> Headroom:
    n = len(pairs)
    spent = sum(r.prefill_flops for r, _ in pairs)
    full = sum(ref.prefill_flops for _, ref in pairs)
    # What a request costs more when it is prefilled in full instead.
    extra = [max(0.0, ref.prefill_flops - r.prefill_flops) for r, ref in pairs]
    close = [r.kl is not None and r.kl <= t.kl for r, _ in pairs]
    agree = [bool(r.top1) for r, _ in pairs]
    # (needed, the requests that can help): a full prefill fixes a request that misses a target.
    needs = [
        (math.ceil(t.close_share * n - 1e-9) - sum(close), [i for i in range(n) if not close[i]]),
        (math.ceil(t.top1 * n - 1e-9) - sum(agree), [i for i in range(n) if not agree[i]]),
    ]
    judged = all(r.correct is not None and ref.correct is not None for r, ref in pairs)
    accuracy_diff = None
    if judged:
        correct = sum(bool(r.correct) for r, _ in pairs)
        correct_ref = sum(bool(ref.correct) for _, ref in pairs)
        accuracy_diff = 100.0 * (correct - correct_ref) / n
        # Only a request the full prefill answers and the system does not gains an answer.
        gains = [i for i, (r, ref) in enumerate(pairs) if ref.correct and not r.correct]
        needs.append((math.ceil(correct_ref - t.accuracy_drop * n - correct - 1e-9), gains))
    fallbacks, bound = 0, 0.0
    for needed, helpers in needs:
        if needed <= 0:
            continue
        assert needed <= len(helpers), "prefilling every request in full meets every target"
        fallbacks = max(fallbacks, needed)
        bound = max(bound, sum(sorted(extra[i] for i in helpers)[:needed]))
    return Headroom(
        system=system,
        setting=setting,
        requests=n,
        close_share=sum(close) / n,
        top1=sum(agree) / n,
        accuracy_diff=accuracy_diff,
        flops_share=spent / full,
        fallbacks=fallbacks,
        flops_bound=(spent + bound) / full,
    )


def table(rows: Sequence[Headroom], targets: Targets = Targets()) -> str:
    head = (
        f"| setting | system | requests | KL ≤ {targets.kl:g} | top-1 | Δ accuracy (points) | FLOPs "
        "| full prefills needed, at least | FLOPs to meet the targets, at least |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for h in rows:
        diff = "–" if h.accuracy_diff is None else f"{h.accuracy_diff:+.1f}"
        setting = h.setting or "all"
        lines.append(
            f"| {setting} | {h.system} | {h.requests} | {h.close_share:.0%} | {h.top1:.0%} | {diff} "
            f"| {h.flops_share:.1%} | {h.fallbacks} ({h.fallbacks / h.requests:.0%}) | {h.flops_bound:.1%} |"
        )
    return "\n".join(lines)


LEGEND = (
    "Targets: {close:.0%} of requests within KL {kl:g} of the full prefill, first-token agreement "
    "{top1:.0%}, accuracy at most {drop:g} point below it. The last two columns bound any policy that "
    "splices as this system does and prefills the requests it would get wrong in full, even one told in "
    "advance which they are: it needs at least that many full prefills and that share of the full "
    "prefill's FLOPs (the largest of the three targets' own bounds; bench/analyses/headroom.py)."
)


def legend(targets: Targets = Targets()) -> str:
    return LEGEND.format(
        close=targets.close_share, kl=targets.kl, top1=targets.top1, drop=100 * targets.accuracy_drop
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python bench/analyses/headroom.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, each with a results.json")
    args = parser.parse_args(argv)
    for run in args.runs:
        result = BenchResult.from_json((run / "results.json").read_text())
        rows = headroom(result.records, result.systems[0])
        print(f"{run}\n\n{table(rows) if rows else 'nothing compared with a full prefill'}\n")
    print(legend())


if __name__ == "__main__":
    main()
