"""`kvsplice bench WORKLOAD`: run a workload on the systems side by side, print the headline table,
write DIR/report.md (the headline, then every column and the details), DIR/results.json and the plots."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from kvsplice.bench.base import WorkloadSpec
from kvsplice.bench.systems import DEFAULT_BUDGETS, DEFAULT_SYSTEMS, SWEEP_BUDGETS, parse_systems
from kvsplice.bench.workloads import make_workload
from kvsplice.config import EngineConfig
from kvsplice.errors import ConfigError

WORKLOAD_HELP = {
    "rag": "k passages per request from a shared pool, in a new order each time (MuSiQue when present)",
    "qa": "synthetic multi-document QA: an access code planted in one document; accuracy",
    "chat": "multi-turn conversations, each turn extending the previous prompt (per-turn tables)",
    "agent": "fixed system prompt and tools, a growing history re-sending earlier tool outputs",
    "fewshot": "the same labelled examples in a new order per request; accuracy",
    "recall": "multi-document fact recall with same-kind distractors, 4, 8 and 12 documents, the answer "
    "first, middle or last; accuracy with confidence intervals by setting and position",
    "traffic": "real servers (splice, radix, hash) under open-loop Poisson load of plain RAG chat requests: "
    "TTFT, throughput, goodput, compute with background work, reuse (kvsplice/bench/traffic.py)",
    "router": "traffic's load on replicas sharing Redis behind vllm-router: one replica of one or two "
    "threads, two of one thread, round robin and cache_aware (kvsplice/bench/traffic_router.py)",
}


# Engine fields each system or the bench itself decides: the prefix cache and the repair are the
# system's, the pool is sized per engine from --kv-cache-gb, requests run one at a time and greedy
# (--seed is the workload's).
SET_PER_ENGINE = frozenset(
    {"prefix_cache", "repair", "recompute_ratio", "kv_cache_gb", "max_num_seqs", "seed"}
)


def _numbers(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def add_bench_command(commands: argparse._SubParsersAction) -> None:
    """Register `bench` on the CLI's subcommands."""
    parser = commands.add_parser(
        "bench",
        help="run a workload on no cache, hash and radix prefix caches and splicing side by side",
        description=__doc__,
        epilog="workloads: " + "; ".join(f"{k}: {v}" for k, v in WORKLOAD_HELP.items()),
    )
    parser.add_argument("workload", choices=sorted(WORKLOAD_HELP))
    parser.add_argument(
        "--systems",
        nargs="+",
        default=None,
        help="off, hash, radix, splice (every policy and budget), splice:<policy>, "
        "splice:<policy>@<percent>; space- or comma-separated. off, the reference, always runs. "
        f"Default: {' '.join(DEFAULT_SYSTEMS)} (the engine's repair policy); the published baselines "
        "are splice:none, splice:boundary and splice:deviation.",
    )
    parser.add_argument(
        "--budgets",
        nargs="+",
        default=None,
        help="repair budgets in percent of the reused segment tokens, for systems named without one "
        f"(default: {' '.join(f'{b:g}' for b in DEFAULT_BUDGETS)}; a sweep: "
        f"{' '.join(f'{b:g}' for b in SWEEP_BUDGETS)}; none runs at 0 only, full at 100 only)",
    )
    sizes = parser.add_argument_group("workload sizes (defaults per workload)")
    sizes.add_argument(
        "--requests",
        type=int,
        help="measured requests (chat: conversations; agent: measured episodes; recall: per setting)",
    )
    sizes.add_argument("--seed", type=int, default=0)
    sizes.add_argument(
        "--docs",
        type=int,
        nargs="+",
        help="documents per request (rag, qa); examples (fewshot); recall: one or more settings "
        "(default 4 8 12)",
    )
    sizes.add_argument(
        "--pool", type=int, help="shared documents the requests draw from (recall: per setting)"
    )
    sizes.add_argument("--turns", type=int, help="turns per conversation (chat), steps per episode (agent)")
    sizes.add_argument(
        "--doc-words",
        type=int,
        help="cut documents to at most this many words (qa, recall: before the planted facts)",
    )
    sizes.add_argument(
        "--source",
        choices=("auto", "musique", "synthetic"),
        default="auto",
        help="text for rag, chat and agent: MuSiQue from ../shared/data when present, else synthetic",
    )
    parser.add_argument(
        "--unmarked",
        action="store_true",
        help="also send every request without markup (one plain string) to a twin of each splice "
        "system, named <system>/plain: what auto_segments finds next to what the markup gives",
    )
    traffic = parser.add_argument_group(
        "traffic (--requests: per mix, rate and system; --docs: passages each)"
    )
    traffic.add_argument("--mixes", nargs="+", help="popular, novel (default: both)")
    traffic.add_argument(
        "--marked",
        action="store_true",
        help="send each passage as a content part marked as a segment (default: plain strings)",
    )
    traffic.add_argument(
        "--deployments", nargs="+", help="router: 1x1, 1x2, 2x1-rr, 2x1-cache (default: all; 1x1 always)"
    )
    traffic.add_argument(
        "--rates",
        type=float,
        nargs="+",
        help="requests/s (default: 0.25, 0.5, 1 and 2 x the requests/s one idle server sustains, measured)",
    )
    run = parser.add_argument_group("run")
    run.add_argument(
        "--skip-warmup",
        action="store_true",
        help="send only the measured requests: shared content is new to every pool, so with "
        "--store-dir or --store-url filled by an earlier run it comes from there, as after a restart",
    )
    run.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: out/bench/WORKLOAD; traffic, router: bench/results/WORKLOAD)",
    )
    run.add_argument("--continuation", type=int, default=16, help="greedy tokens compared per request")
    run.add_argument(
        "--kv-cache-gb",
        type=float,
        default=8.0,
        help="all engines' (traffic: servers') KV pools together, at most",
    )
    run.add_argument("--no-plots", action="store_true")
    run.add_argument(
        "--details",
        action="store_true",
        help="print the whole report (every column, per-turn and per-setting tables, notes), not only "
        "the headline table; DIR/report.md has it either way (traffic prints its whole report)",
    )
    run.add_argument("--no-progress", action="store_true")
    engine = parser.add_argument_group("engine (as for kvsplice serve; the systems set the rest)")
    EngineConfig.add_args(engine, exclude=SET_PER_ENGINE)
    parser.set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> None:
    if args.workload in ("traffic", "router"):
        _traffic(args)
        return
    from kvsplice.bench.harness import BenchConfig, run_bench
    from kvsplice.bench.report import headline, write

    try:
        budgets = tuple(_numbers(" ".join(args.budgets))) if args.budgets else None
        docs = args.docs or []
        spec = WorkloadSpec(
            requests=args.requests,
            seed=args.seed,
            docs=docs[0] if len(docs) == 1 else None,
            doc_counts=tuple(docs) if len(docs) > 1 else None,
            pool=args.pool,
            turns=args.turns,
            doc_words=args.doc_words,
            source=args.source,
        )
        config = BenchConfig(
            workload=args.workload,
            spec=spec,
            systems=tuple(args.systems or ()),
            budgets=budgets,
            unmarked=args.unmarked,
            skip_warmup=args.skip_warmup,
            continuation=args.continuation,
            engine=EngineConfig.from_args(args),
            kv_cache_gb=args.kv_cache_gb,
            progress=not args.no_progress,
            command=shlex.join(["kvsplice", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else "",
        )
        if config.continuation < 1:
            raise ValueError("--continuation must be >= 1")
        # Bad names and sizes are the user's mistake: one line, before any model loads.
        workload = make_workload(args.workload, spec)
        parse_systems(config.systems, budgets or DEFAULT_BUDGETS)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from err
    result = run_bench(config, workload)
    out = args.out or Path("out") / "bench" / args.workload
    report = write(result, out, plots=not args.no_plots)
    print(
        report if args.details else headline(result) + f"\nEvery column, notes and plots: {out / 'report.md'}"
    )
    print(f"[wrote {out / 'report.md'}, {out / 'results.json'}]", file=sys.stderr)


def _traffic(args: argparse.Namespace) -> None:
    """traffic and router drive `kvsplice serve` processes rather than in-process engines: modules of
    their own."""
    from kvsplice.bench import traffic, traffic_router

    try:
        if args.workload == "router":
            config, layouts = traffic_router.config_from_args(args)
        elif args.deployments:
            raise ValueError("--deployments is for bench router")
        else:
            config = traffic.config_from_args(args)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(str(err)) from err
    if args.workload == "router":
        traffic_router.main(config, layouts, args.out)
    else:
        traffic.main(config, args.out)
