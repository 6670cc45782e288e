"""The full prefill's own noise floor: a full prefill in another precision against the float32 full
prefill of the same requests, beside what a splice system of the float32 run does to them.

    python bench/analyses/precision.py BASE OTHER [--system splice:attention@15]

BASE is a run with the full prefill (`off`) and the splice system, OTHER a run of the same workload,
model and seed with `--systems off` and another `--kv-dtype` (or `--dtype`): the same requests, prefilled
in full with KV stored as a serving engine stores it (vLLM keeps a bfloat16 model's KV in bfloat16). Where
the float32 full prefill leads its runner-up by little, any perturbation flips its answer; how often the
other precision does shows how much of a splice's accuracy difference there is below what serving in
that precision already changes. First-token agreement is read from the generated tokens, so both runs'
first tokens are compared, not distributions (a bench run keeps no logits).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pool import interval  # bench/analyses/ is on the path

from kvsplice.bench.metrics import RequestRecord
from kvsplice.bench.results import BenchResult
from kvsplice.bench.stats import Interval, paired_difference, wilson

REFERENCE = "off"
# The float32 full prefill's margin (top-1 minus runner-up probability) from which it counts as sure.
SURE = 0.1
# Spec entries the two runs may differ in: the precision, and which systems ran.
_MAY_DIFFER = ("dtype", "kv_dtype", "systems")


@dataclass(frozen=True)
class Row:
    """One way of serving the requests against the float32 full prefill of the same requests."""

    name: str
    requests: int
    accuracy: float
    reference_accuracy: float
    # accuracy(this) - accuracy(float32 full prefill), paired.
    accuracy_delta: Interval
    first_token: Interval
    # First-token agreement where the float32 full prefill is sure (margin >= SURE), and where it is not,
    # with the number of requests of each.
    sure: Interval | None
    sure_requests: int
    torn: Interval | None
    torn_requests: int
    # Requests whose whole generated continuation is the float32 full prefill's.
    same_answer: Interval


def compare(base: BenchResult, other: BenchResult, system: str) -> list[Row]:
    """The other precision's full prefill and `system` of the base run, each against the base run's full
    prefill, on the requests all three answered; ValueError for runs of different requests."""
    if base.model is None or other.model is None or base.model.parameters != other.model.parameters:
        raise ValueError("the runs are of different models")
    if (base.model.dtype, base.model.kv_dtype) == (other.model.dtype, other.model.kv_dtype):
        raise ValueError(
            f"both runs are in {base.model.dtype} with {base.model.kv_dtype} KV: nothing to compare"
        )
    kept = {k: v for k, v in base.spec.items() if k not in _MAY_DIFFER}
    theirs = {k: v for k, v in other.spec.items() if k not in _MAY_DIFFER}
    if base.workload != other.workload or kept != theirs:
        raise ValueError(
            f"{other.command!r} measured other requests than {base.command!r}: "
            f"{other.workload} {theirs} against {base.workload} {kept}"
        )
    if system not in base.systems:
        raise ValueError(f"the base run ({base.command}) has no system {system!r}; it has {base.systems}")
    reference = _answered(base, REFERENCE)
    precise = _answered(other, REFERENCE)
    spliced = _answered(base, system)
    ids = sorted(reference.keys() & precise.keys() & spliced.keys())
    if not ids:
        raise ValueError("the runs answered no request in common")
    name = f"full prefill, {other.model.dtype} with {other.model.kv_dtype} KV"
    return [
        _row(name, [(precise[i], reference[i]) for i in ids]),
        _row(system, [(spliced[i], reference[i]) for i in ids]),
    ]


def _answered(result: BenchResult, system: str) -> dict[str, RequestRecord]:
    return {
        r.request_id: r
        for r in result.records
        if r.system == system and not r.warmup and r.ok and r.token_ids
    }


def _row(name: str, pairs: Sequence[tuple[RequestRecord, RequestRecord]]) -> Row:
    """`pairs`: (a request served this way, the float32 full prefill of it)."""
    n = len(pairs)
    outcomes = [(bool(a.correct), bool(ref.correct)) for a, ref in pairs]
    delta = paired_difference(outcomes)
    first = [(a.token_ids[0] == ref.token_ids[0], ref.margin or 0.0) for a, ref in pairs]
    same = wilson(sum(a.token_ids == ref.token_ids for a, ref in pairs), n)
    top1 = wilson(sum(agree for agree, _ in first), n)
    assert delta is not None and same is not None and top1 is not None, "a row has pairs"
    sure = [agree for agree, margin in first if margin >= SURE]
    torn = [agree for agree, margin in first if margin < SURE]
    return Row(
        name,
        n,
        sum(a for a, _ in outcomes) / n,
        sum(b for _, b in outcomes) / n,
        delta,
        top1,
        wilson(sum(sure), len(sure)),
        len(sure),
        wilson(sum(torn), len(torn)),
        len(torn),
        same,
    )


def table(rows: Sequence[Row]) -> str:
    r = rows[0]
    out = [
        f"Against the float32 full prefill of the same {r.requests} requests (95% intervals); it is sure "
        f"(leads its runner-up by ≥ {SURE:g}) on {r.sure_requests} of them and torn on {r.torn_requests}",
        "",
        "| served as | accuracy (float32 full) | Δ accuracy, points | first token | first token where sure "
        "| first token where torn | whole answer the same |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.name} | {100 * r.accuracy:.1f}% ({100 * r.reference_accuracy:.1f}%) "
            f"| {interval(r.accuracy_delta, True)} | {interval(r.first_token)} "
            f"| {interval(r.sure)} | {interval(r.torn)} | {interval(r.same_answer)} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python bench/analyses/precision.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("base", type=Path, help="a run with off and the splice system (float32)")
    parser.add_argument(
        "other", type=Path, help="a run of the same requests with --systems off in another precision"
    )
    parser.add_argument("--system", default="splice:attention@15", help="the base run's splice system")
    args = parser.parse_args(argv)
    try:
        base, other = (
            BenchResult.from_json((d / "results.json").read_text()) for d in (args.base, args.other)
        )
        rows = compare(base, other, args.system)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    print(table(rows))


if __name__ == "__main__":
    main()
