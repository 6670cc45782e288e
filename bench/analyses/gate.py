"""A fallback gated on the system's own confidence: prefill in full every request whose first-token
margin after splicing is below a threshold.

headroom.py bounds a fallback told in advance which requests miss the targets. A serving system is not
told; what it has after a spliced prefill is its own next-token distribution. Where the full prefill
is torn between two tokens (most first-token flips, docs/fidelity.md) the spliced one is likely torn
too, so its margin (top probability minus the runner-up's) is the signal a gate can use. This replays
recorded runs, whose records carry both margins, with such a gate: a request whose own margin is below
θ pays for its spliced prefill and then a full one, and gets the full prefill's result (KL 0, its
first token, its answer). A full prefill agrees with itself exactly, so the replay is what the gate
would give, without running it.

A threshold chosen on a run and replayed on the same run is tuned on it; `--threshold` replays a
threshold chosen elsewhere (another seed) as a held-out check.

    python bench/analyses/gate.py DIR [DIR ...]                  the least θ per target, per run
    python bench/analyses/gate.py DIR [DIR ...] --threshold 0.03  that θ replayed on each run
    python bench/analyses/gate.py DIR [DIR ...] --pool            the runs' requests together
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from headroom import Pair, Targets, paired  # bench/analyses/ is on the path

from kvsplice.bench.metrics import RequestRecord
from kvsplice.bench.results import BenchResult

# The issue's targets (headroom.Targets' defaults).
TARGETS = Targets()


@dataclass(frozen=True)
class GatePoint:
    """A system's requests replayed with the gate at `threshold` (requests with margin < threshold
    are prefilled in full after the spliced attempt)."""

    threshold: float
    requests: int
    gated: int
    close_share: float
    top1: float
    # Accuracy minus the full prefill's, in points (None where answers are not judged).
    accuracy_diff: float | None
    # Of the full prefill's FLOPs: every spliced prefill plus the gated requests' full ones.
    flops_share: float

    def meets(self, t: Targets, top1_only: bool = False) -> bool:
        if self.top1 < t.top1 - 1e-9:
            return False
        if top1_only:
            return True
        accurate = self.accuracy_diff is None or self.accuracy_diff >= -100.0 * t.accuracy_drop - 1e-9
        return self.close_share >= t.close_share - 1e-9 and accurate


def replay(pairs: Sequence[Pair], threshold: float, t: Targets = TARGETS) -> GatePoint:
    """The gate at `threshold` over (system, full prefill) record pairs of the same requests."""
    assert pairs and all(r.margin is not None for r, _ in pairs), "the records carry the system's margin"
    n = len(pairs)
    # (gated, system record, full prefill record) per request.
    rows = [(r.margin is not None and r.margin < threshold, r, ref) for r, ref in pairs]
    close = sum(g or (r.kl is not None and r.kl <= t.kl) for g, r, _ in rows)
    agree = sum(g or bool(r.top1) for g, r, _ in rows)
    judged = all(r.correct is not None and ref.correct is not None for r, ref in pairs)
    accuracy_diff = None
    if judged:
        correct = sum(bool(ref.correct if g else r.correct) for g, r, ref in rows)
        accuracy_diff = 100.0 * (correct - sum(bool(ref.correct) for _, ref in pairs)) / n
    spent = sum(r.prefill_flops + (ref.prefill_flops if g else 0.0) for g, r, ref in rows)
    return GatePoint(
        threshold=threshold,
        requests=n,
        gated=sum(g for g, _, _ in rows),
        close_share=close / n,
        top1=agree / n,
        accuracy_diff=accuracy_diff,
        flops_share=spent / sum(ref.prefill_flops for _, ref in pairs),
    )


def least(pairs: Sequence[Pair], t: Targets = TARGETS, top1_only: bool = False) -> GatePoint | None:
    """The cheapest gate that meets the targets (the first-token one alone with `top1_only`), or None
    when not even gating every request does (it always does: a full prefill meets every target)."""
    # Only the distinct margins matter: a threshold just above each gates it and every smaller one.
    candidates = [
        0.0,
        *sorted({math.nextafter(r.margin, math.inf) for r, _ in pairs if r.margin is not None}),
    ]
    points = [replay(pairs, c, t) for c in candidates]
    meeting = [p for p in points if p.meets(t, top1_only)]
    return min(meeting, key=lambda p: (p.flops_share, p.threshold)) if meeting else None


@dataclass(frozen=True)
class GateRow:
    setting: str
    system: str
    own: GatePoint
    top1: GatePoint | None
    every: GatePoint | None


def replayable(records: Sequence[RequestRecord], reference: str) -> dict[tuple[str, str], list[Pair]]:
    """`paired`'s groups whose records can be replayed: each keeps the margin of the system's own
    splice. Not those of a system that ran with a fallback margin and fell back (`+fallback<m>`): a
    request it prefilled in full keeps the full prefill's margin, and has paid for it already."""
    return {
        key: pairs
        for key, pairs in paired(records, reference).items()
        if all(r.margin is not None and not r.fell_back for r, _ in pairs)
    }


def gates(records: Sequence[RequestRecord], reference: str, t: Targets = TARGETS) -> list[GateRow]:
    """Per setting and system that can be replayed: the system as it ran and its least gates."""
    return [
        GateRow(setting, system, replay(pairs, 0.0, t), least(pairs, t, True), least(pairs, t))
        for (setting, system), pairs in replayable(records, reference).items()
    ]


def _cell(p: GatePoint | None) -> str:
    if p is None:
        return "–"
    return f"{p.threshold:.3f}: {p.gated} ({p.gated / p.requests:.0%}), {p.flops_share:.1%}"


def table(rows: Sequence[GateRow], t: Targets = TARGETS) -> str:
    lines = [
        f"| setting | system | requests | FLOPs | top-1 | KL ≤ {t.kl:g} | least θ for top-1 ≥ {t.top1:.0%}: "
        "gated, FLOPs | least θ for every target: gated, FLOPs |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        o = row.own
        lines.append(
            f"| {row.setting or 'all'} | {row.system} | {o.requests} | {o.flops_share:.1%} | {o.top1:.0%} "
            f"| {o.close_share:.0%} | {_cell(row.top1)} | {_cell(row.every)} |"
        )
    return "\n".join(lines)


def points_table(points: Sequence[tuple[str, str, GatePoint]], t: Targets = TARGETS) -> str:
    lines = [
        f"| run | system | θ | requests | gated | KL ≤ {t.kl:g} | top-1 | Δ accuracy (points) | FLOPs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run, system, p in points:
        diff = "–" if p.accuracy_diff is None else f"{p.accuracy_diff:+.1f}"
        lines.append(
            f"| {run} | {system} | {p.threshold:g} | {p.requests} | {p.gated} ({p.gated / p.requests:.0%}) "
            f"| {p.close_share:.0%} | {p.top1:.0%} | {diff} | {p.flops_share:.1%} |"
        )
    return "\n".join(lines)


LEGEND = (
    "A gate prefills in full, after the spliced attempt, every request whose own first-token margin "
    "(top probability minus the runner-up's) is below θ; those requests get the full prefill's result "
    "and cost both prefills. θ is the least that meets the target on this run, so it is tuned on it "
    "(bench/analyses/gate.py; `--threshold` replays one chosen elsewhere)."
)


def _pooled(results: Sequence[BenchResult]) -> list[RequestRecord]:
    """The runs' records together, request ids made distinct per run."""
    return [
        replace(r, request_id=f"{i}/{r.request_id}") for i, res in enumerate(results) for r in res.records
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/analyses/gate.py", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, each with a results.json")
    parser.add_argument("--threshold", type=float, help="replay this θ instead of finding the least")
    parser.add_argument("--pool", action="store_true", help="the runs' requests together (one reference)")
    args = parser.parse_args(argv)
    results = [BenchResult.from_json((run / "results.json").read_text()) for run in args.runs]
    named = [(str(run), res.records, res.systems[0]) for run, res in zip(args.runs, results, strict=True)]
    if args.pool:
        references = {res.systems[0] for res in results}
        if len(references) != 1:
            parser.error(f"the runs have different references: {sorted(references)}")
        named = [("pooled: " + ", ".join(map(str, args.runs)), _pooled(results), results[0].systems[0])]
    if args.threshold is not None:
        points = []
        for name, records, reference in named:
            for (setting, system), pairs in replayable(records, reference).items():
                points.append((f"{name} {setting}".strip(), system, replay(pairs, args.threshold)))
        print(points_table(points) if points else "no run records its systems' margins")
        return
    for name, records, reference in named:
        rows = gates(records, reference)
        print(f"{name}\n\n{table(rows) if rows else 'no system with its margins recorded'}\n")
    print(LEGEND)


if __name__ == "__main__":
    main()
