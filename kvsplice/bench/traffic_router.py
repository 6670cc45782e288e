"""`kvsplice bench router`: bench traffic's workload on deployments instead of single servers.

Every deployment is `kvsplice deploy`'s (kvsplice/deploy.py): replicas with kvsplice's defaults
sharing a redis-server of their own, behind vllm-router. They differ in replicas, threads and policy:
    1x1         one replica, one thread (the baseline: capacity and the SLO are its)
    1x2         one replica, two threads
    2x1-rr      two replicas of one thread, round robin
    2x1-cache   two replicas of one thread, vllm-router's cache_aware policy (a prefix tree per worker)
On a 2-core machine 1x2 and the 2x1 pair use the same cores: the question is whether two engines beat
one engine with twice the threads, and what the shared Redis tier gives back of the reuse a single
replica has in its pool. Everything else (workload, Poisson schedule, calibration, goodput at the
SLO, compute from /metrics, the report's tables) is bench traffic's; compute and reuse are summed
over a deployment's replicas, so "from Redis" is the reuse one replica got from another.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvsplice.bench import traffic
from kvsplice.bench.traffic import Endpoint, TrafficConfig
from kvsplice.bench.traffic_report import TrafficResult, markup, render, run_lines, summarize, write
from kvsplice.config import EngineConfig
from kvsplice.deploy import deploy


@dataclass(frozen=True)
class Layout:
    replicas: int
    threads: int
    policy: str


LAYOUTS = {
    "1x1": Layout(1, 1, "round_robin"),
    "1x2": Layout(1, 2, "round_robin"),
    "2x1-rr": Layout(2, 1, "round_robin"),
    "2x1-cache": Layout(2, 1, "cache_aware"),
}
BASELINE = "1x1"
DEFAULT_OUT = Path("bench/results/router")


def parse_layouts(names: list[str]) -> tuple[str, ...]:
    """The layouts asked for, the baseline always among them; raises ValueError for an unknown one."""
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise ValueError(f"unknown deployment {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    return tuple(dict.fromkeys([BASELINE, *names]))


def run_router_traffic(config: TrafficConfig, layouts: tuple[str, ...]) -> TrafficResult:
    """Start every deployment in `layouts` (all up at once, one cell at a time), then bench traffic."""
    logs = Path(tempfile.mkdtemp(prefix="kvsplice-router-logs-"))

    def start(stack: contextlib.ExitStack) -> dict[str, Endpoint]:
        endpoints = {}
        for name in layouts:
            layout = LAYOUTS[name]
            flags = [*config.server_flags, "--num-threads", str(layout.threads)]
            running = stack.enter_context(
                deploy(layout.replicas, flags, layout.policy, router_log=logs / f"{name}.log")
            )
            endpoints[name] = Endpoint(running.url, tuple(r.url for r in running.replicas))
        print(f"[router] deployments up; the routers' logs are in {logs}", file=sys.stderr, flush=True)
        return endpoints

    result = traffic.measure(config, start, baseline=BASELINE, reference=BASELINE)
    result.config["layouts"] = list(layouts)
    return result


def report(result: TrafficResult) -> str:
    cal, cfg = result.calibration, result.config
    setup = [
        "# Replicas behind vllm-router: one engine, one engine with two threads, two engines",
        "",
        *run_lines(result),
        f"Deployments (`kvsplice deploy`): replicas `kvsplice serve {' '.join(cfg['server_flags'])} "
        "--num-threads T`, each deployment's replicas sharing a redis-server of its own, behind "
        "vllm-router: " + "; ".join(f"{n} = {_describe(LAYOUTS[n])}" for n in cfg["layouts"]) + ". All "
        "up at once, one cell at a time (in a rotated order per rate).",
        f"Requests: bench traffic's (chat, {markup(cfg)}, {cfg['docs']} passages of at most "
        f"{cfg['doc_words']} words and a question, max_tokens={cfg['max_tokens']}, streamed, "
        f"{cfg['requests']} per cell at Poisson arrival times, a fresh cache_salt per mix and rate).",
        f"Calibration (idle, new passages, {cal.prompt_tokens:.0f} prompt tokens, median): "
        + ", ".join(f"{s} TTFT {cal.ttft_s[s]:.2f} s / request {cal.e2e_s[s]:.2f} s" for s in cal.ttft_s)
        + f". Capacity = 1 / {BASELINE}'s request time = {cal.capacity_per_s:.3f} requests/s.",
        f"**SLO: TTFT <= {cal.slo_s:.2f} s** ({cal.slo_factor:g} x {BASELINE}'s idle TTFT). Goodput = "
        "requests within the SLO per second of the cell's wall time.",
        "Compute and reuse: /metrics of every replica of a deployment, summed, read idle before and after "
        f"the cell. Fidelity: sampled requests against a full prefill on {BASELINE} under a fresh salt.",
    ]
    lines = [render(result, setup, baseline=BASELINE).rstrip("\n"), "", "## Across replicas", ""]
    lines += [
        f"Goodput as a multiple of {BASELINE}'s at the same rate, and the share of prompt tokens loaded "
        "from the deployment's Redis (on two replicas: KV one computed and the other reused).",
        "",
        f"| mix | rate (req/s) | deployment | goodput vs {BASELINE} | reused | from Redis |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for cell in sorted(result.cells, key=lambda c: (c.mix, c.rate, c.system)):
        base = next(c for c in result.cells if (c.mix, c.rate, c.system) == (cell.mix, cell.rate, BASELINE))
        goodput, base_goodput = (summarize(c, cal.slo_s).goodput_per_s for c in (cell, base))
        ratio = f"{goodput / base_goodput:.2f}x" if base_goodput else "-"
        prompt = cell.compute.prompt_tokens
        from_redis = cell.compute.store_hit_tokens / prompt if prompt else 0.0
        lines.append(
            f"| {cell.mix} | {cell.rate:.3f} | {cell.system} | {ratio} | {cell.compute.reuse_share:.0%} "
            f"| {from_redis:.0%} |"
        )
    return "\n".join(lines) + "\n"


def _describe(layout: Layout) -> str:
    replicas = f"{layout.replicas} replica{'s' if layout.replicas > 1 else ''}"
    threads = f"{layout.threads} thread{'s' if layout.threads > 1 else ''}"
    return f"{replicas} of {threads}" + (f", {layout.policy}" if layout.replicas > 1 else "")


def config_from_args(args: argparse.Namespace) -> tuple[TrafficConfig, tuple[str, ...]]:
    """bench traffic's run, its KV pool split over every replica and threads left to the layouts; raises
    ValueError for arguments the router bench cannot honour."""
    if args.num_threads is not None:
        raise ValueError("bench router sets --num-threads per deployment (1x2: two); drop --num-threads")
    layouts = parse_layouts(args.deployments or list(LAYOUTS))
    config = traffic.config_from_args(args)
    replicas = sum(LAYOUTS[n].replicas for n in layouts)
    flags = traffic.server_flags(EngineConfig.from_args(args), args.kv_cache_gb / replicas)
    return dataclasses.replace(config, server_flags=tuple(flags)), layouts


def main(config: TrafficConfig, layouts: tuple[str, ...], out: Path | None) -> None:
    """Run, print the report, write DIR/report.md and DIR/results.json (DIR: out or DEFAULT_OUT)."""
    result = run_router_traffic(config, layouts)
    out = out or DEFAULT_OUT
    print(write(result, out, report(result)))
    print(f"[wrote {out / 'report.md'}, {out / 'results.json'}]", file=sys.stderr)
