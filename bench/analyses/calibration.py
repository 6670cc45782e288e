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

from kvsplice.bench.metrics import RequestRecord
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
    # None where the workload has no answers to judge.
    delta: Interval | None
    delta_replayed: Interval | None


def replay(name: str, result: BenchResult, system: str, first: int) -> Replayed:
    done = [r for r in result.records if not r.warmup and r.ok]
    reference = {r.request_id: r for r in done if r.system == "off"}
    spliced = [r for r in done if r.system == system and r.request_id in reference]
    if len(spliced) <= first:
        raise ValueError(f"{name}: {len(spliced)} requests of {system}, no more than the {first} replayed")
    kls = [r.kl or 0.0 for r in spliced]
    n = len(kls)
    replayed = [0.0 if i < first else kl for i, kl in enumerate(kls)]
    return Replayed(
        name,
        n,
        sum(kls) / n,
        sum(replayed) / n,
        sum(kls[first:]) / (n - first),
        *_deltas(spliced, reference, first),
    )


def _deltas(
    spliced: Sequence[RequestRecord], reference: dict[str, RequestRecord], first: int
) -> tuple[Interval | None, Interval | None]:
    if any(r.correct is None for r in spliced):
        return None, None
    pairs = [(bool(r.correct), bool(reference[r.request_id].correct)) for r in spliced]
    replayed = [(full, full) if i < first else (own, full) for i, (own, full) in enumerate(pairs)]
    return paired_difference(pairs), paired_difference(replayed)


def _delta(d: Interval | None) -> str:
    return "–" if d is None else f"{100 * d.estimate:+.1f} [{100 * d.low:+.1f}, {100 * d.high:+.1f}]"


def table(rows: Sequence[Replayed], first: int) -> str:
    out = [
        f"| run | requests | KL | KL, first {first} in full | KL after them | Δ accuracy, points "
        f"| Δ, first {first} in full |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.run} | {r.requests} | {r.kl_mean:.4f} | {r.kl_replayed:.4f} | {r.kl_after:.4f} "
            f"| {_delta(r.delta)} | {_delta(r.delta_replayed)} |"
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
