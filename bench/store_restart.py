"""`kvsplice bench rag` across a restart (disk tier) and across replicas (Redis), on the default model.

Against the single-process store.
Four runs of the same rag workload, each a new process (what a restart or another replica is):

    one process      --store-dir D --store-url R   warm-ups introduce the passages; the measured
                                                   requests find them in the pool (and write them below)
    restart, disk    --store-dir D --skip-warmup   a new process: the passages are new to its pool and
                                                   come from the directory the first one wrote
    replica, Redis   --store-url R --skip-warmup   a new process with no directory: from redis-server
    restart, none    --skip-warmup                 a new process without tiers: the passages are computed

Each run has its own full-prefill reference (`off`), so speedups compare within a run; the table also
says whether each request's greedy continuation equals the one-process run's (a tier hit must give
the KV the first process had, bit for bit, in float32).

    python bench/store_restart.py [--requests 6] [--out bench/results/store_restart.md] [-- extra bench flags]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvsplice.bench.metrics import RequestRecord
from kvsplice.bench.results import BenchResult
from kvsplice.bench.server_process import redis_server

SYSTEM = "splice:attention@15"


@dataclass(frozen=True)
class Phase:
    name: str
    disk: bool
    redis: bool
    skip_warmup: bool


PHASES = (
    Phase("one process", disk=True, redis=True, skip_warmup=False),
    Phase("restart, disk", disk=True, redis=False, skip_warmup=True),
    Phase("replica, Redis", disk=False, redis=True, skip_warmup=True),
    Phase("restart, no tiers", disk=False, redis=False, skip_warmup=True),
)


def run_phase(phase: Phase, args: argparse.Namespace, store: Path, redis_url: str, out: Path) -> BenchResult:
    command = [sys.executable, "-m", "kvsplice.cli", "bench", "rag", "--systems", SYSTEM, "--requests",
               str(args.requests), "--no-plots", "--no-progress", "--out", str(out), *args.extra]  # fmt: skip
    command += ["--store-dir", str(store)] if phase.disk else []
    command += ["--store-url", redis_url] if phase.redis else []
    command += ["--skip-warmup"] if phase.skip_warmup else []
    print(f"[{phase.name}] {' '.join(command[2:])}", file=sys.stderr)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return BenchResult.from_json((out / "results.json").read_text())


def measured(result: BenchResult, system: str) -> list[RequestRecord]:
    return [r for r in result.records if r.system == system and not r.warmup and r.ok]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def report(results: dict[str, BenchResult], command: str) -> str:
    first = next(iter(results.values()))
    baseline = {r.request_id: r.token_ids for r in measured(first, SYSTEM)}
    disk = {r.request_id: r.token_ids for r in measured(results[PHASES[1].name], SYSTEM)}
    lines = [
        "# Segment KV across a restart and across replicas",
        "",
        f"`{command}`. Workload: {first.description} ({first.spec['requests']} measured requests, "
        f"{first.spec['docs']} of {first.spec['pool']} passages each). System `{SYSTEM}` (the default "
        f"repair at 15%), each run with its own full-prefill reference `off`. Machine: {first.machine.cpu}, "
        f"torch {first.machine.torch_version} ({first.machine.torch_threads} thread(s)), kvsplice "
        f"commit {first.machine.git_commit}.",
        "",
        "| run | segment | from disk | from redis | load ms (1st request) | TTFT 1st request ms "
        "| off 1st ms | TTFT p50 ms | off p50 ms | speedup p50 | KL | top-1 | same as one process "
        "| same as restart, disk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        spliced, full = measured(result, SYSTEM), measured(result, "off")
        summary = next(s for s in result.summaries if s.system == SYSTEM)
        tiers = summary.tier_hit_frac
        same = sum(baseline.get(r.request_id) == r.token_ids for r in spliced)
        same_disk = sum(disk.get(r.request_id) == r.token_ids for r in spliced)
        cells = [
            f"{(summary.segment_hit_frac or 0) * 100:.1f}%",
            f"{tiers.get('disk', 0) * 100:.1f}%",
            f"{tiers.get('redis', 0) * 100:.1f}%",
            f"{spliced[0].store_load_s * 1000:,.0f}",
            ms(spliced[0].ttft_s),
            ms(full[0].ttft_s),
            ms(statistics.median(r.ttft_s for r in spliced)),
            ms(statistics.median(r.ttft_s for r in full)),
            f"{summary.speedup_p50 or 0:.2f}×",
            f"{summary.kl_mean or 0:.4f}",
            f"{(summary.top1_rate or 0) * 100:.0f}%",
            f"{same}/{len(spliced)}",
            f"{same_disk}/{len(spliced)}",
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "segment: prompt tokens moved from the segment store; from disk / from redis: those loaded from "
        "that tier (the rest were in the pool: a passage loaded once is a pool hit for later requests); "
        "load ms: reading, verifying and decoding the first measured request's passages (part of its TTFT); "
        "1st request: the first measured request, whose passages are all new to a restarted pool. "
        "KL, top-1: against the run's own full prefill. same as one process / restart, disk: requests "
        "whose greedy continuation equals that run's.",
        "",
        "Tier counters at the end of each run:",
        "",
        "| run | tier | hits | misses | corrupt | errors | MiB read | MiB written | writes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        for tier, c in result.tier_stats.get("splice", {}).items():
            lines.append(
                f"| {name} | {tier} | {c['hits']:,.0f} | {c['misses']:,.0f} | {c['corrupt']:,.0f} "
                f"| {c['errors']:,.0f} | {c['bytes_read'] / 2**20:,.1f} | {c['bytes_written'] / 2**20:,.1f} "
                f"| {c['writes']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("bench/results/store_restart.md"))
    parser.add_argument("extra", nargs="*", help="more `kvsplice bench rag` flags (after --)")
    args = parser.parse_args()
    command = " ".join(["python", "bench/store_restart.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="kvsplice-restart-") as tmp:
        work = Path(tmp)
        with redis_server(work) as redis_url:
            results = {
                phase.name: run_phase(phase, args, work / "store", redis_url, work / f"run{i}")
                for i, phase in enumerate(PHASES)
            }
        # Each run's own bench report beside the summary, named by its run.
        runs = args.out.with_suffix("")
        runs.mkdir(parents=True, exist_ok=True)
        for i, phase in enumerate(PHASES):
            slug = phase.name.replace(", ", "_").replace(" ", "_").lower()
            for name in ("report.md", "results.json"):
                text = (work / f"run{i}" / name).read_text()
                (runs / f"{slug}{Path(name).suffix}").write_text(text)
    text = report(results, command)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
