"""What the trust gate's calibration phase costs in fidelity, replayed on recorded runs.

    python bench/analyses/calibration.py DIR [DIR ...] [--system splice:attention@15] [--first 10]

While a prompt shape calibrates, the gate has no threshold for it, and its first MIN_SAMPLES requests
are spliced unchecked (repair/gate.py). This replays each run as if those requests had been answered
by the full prefill instead (KL 0, the full prefill's answer): the mean first-token KL and the paired
accuracy difference as measured, as replayed, and over the requests after calibration. Each run is
taken as one shape (recall, few-shot, QA and RAG runs are: one document count and size per run), its
spliced requests in the order they ran.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pool import Pair, interval, pairs  # bench/analyses/ is on the path

from kvsplice.bench.results import BenchResult
from kvsplice.bench.stats import Interval, paired_difference
from kvsplice.repair.gate import MIN_SAMPLES


@dataclass(frozen=True)
class Replayed:
    run: str
    requests: int
    kl_mean: float
    kl_replayed: float
    # Over the requests after the first `first`: what the gate serves once it has calibrated.
    kl_after: float
    delta: Interval
    delta_replayed: Interval


def replay(name: str, result: BenchResult, system: str, first: int) -> Replayed:
    by_setting = pairs(result, system)
    if len(by_setting) != 1:
        raise ValueError(f"{name}: settings {sorted(by_setting)}; a replay takes a run of one prompt shape")
    (both,) = by_setting.values()
    if len(both) <= first:
        raise ValueError(f"{name}: {len(both)} requests of {system}, no more than the {first} replayed")
    kls = [p.system.kl or 0.0 for p in both]
    n = len(kls)
    replayed = [0.0 if i < first else kl for i, kl in enumerate(kls)]
    delta, delta_replayed = _deltas(both, first)
    return Replayed(
        name, n, sum(kls) / n, sum(replayed) / n, sum(kls[first:]) / (n - first), delta, delta_replayed
    )


def _deltas(both: Sequence[Pair], first: int) -> tuple[Interval, Interval]:
    """The paired accuracy difference as measured, and with the first `first` answered as in full."""
    outcomes = [(bool(p.system.correct), bool(p.reference.correct)) for p in both]
    replayed = [(full, full) if i < first else (own, full) for i, (own, full) in enumerate(outcomes)]
    delta, delta_replayed = paired_difference(outcomes), paired_difference(replayed)
    assert delta is not None and delta_replayed is not None, "a replay has pairs"
    return delta, delta_replayed


def table(rows: Sequence[Replayed], first: int) -> str:
    out = [
        f"| run | requests | KL | KL, first {first} in full | KL after them | Δ accuracy, points "
        f"| Δ, first {first} in full |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.run} | {r.requests} | {r.kl_mean:.4f} | {r.kl_replayed:.4f} | {r.kl_after:.4f} "
            f"| {interval(r.delta, True)} | {interval(r.delta_replayed, True)} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python bench/analyses/calibration.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, each with a results.json")
    parser.add_argument("--system", default="splice:attention@15", help="the splice system replayed")
    parser.add_argument("--first", type=int, default=MIN_SAMPLES, help="requests answered in full")
    args = parser.parse_args(argv)
    try:
        rows = [
            replay(d.name, BenchResult.from_json((d / "results.json").read_text()), args.system, args.first)
            for d in args.runs
        ]
    except (ValueError, OSError) as err:
        parser.error(str(err))
    print(table(rows, args.first))


if __name__ == "__main__":
    main()
