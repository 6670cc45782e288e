"""Serving throughput: the same requests one by one, then from 8 concurrent clients, against a real
`kvsplice serve` in a subprocess, driven by the `openai` client.

Every request is a distinct short completion prompt with `ignore_eos`, greedy, `--max-tokens`
tokens, so both phases generate exactly the same number of tokens. Each phase sends its requests
under a cache salt of its own, so the second phase reuses nothing the first one cached. Phases
alternate for `--rounds` rounds (one by one, concurrent, one by one, ...) so that other load on the
machine falls on both; the ratio is taken per round, from the phases run side by side.

Throughput = generated tokens / wall time of the phase. The engine batches the decode steps of all
running requests; prefills run one request per step, ahead of decodes. `--num-threads 1 0` runs the
whole comparison once per torch thread setting (0 = torch's default), each with a server of its own:
on a small machine that other work also loads, one intra-op thread can beat two by far.

Run: python bench/serve_concurrency.py   (a few minutes on 2 CPU cores; writes bench/results/...md)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import torch

from kvsplice.bench.results import cpu_name
from kvsplice.bench.server_process import serve

RESULT = Path(__file__).parent / "results" / "serve_concurrency.md"
TOPICS = ["rivers", "mountains", "deserts", "oceans", "forests", "volcanoes", "glaciers", "islands",
          "lakes", "canyons", "caves", "reefs", "plains", "valleys", "storms", "tides"]  # fmt: skip


@dataclass(frozen=True)
class Phase:
    name: str
    concurrency: int
    requests: int
    generated_tokens: int
    seconds: float
    latencies: list[float]
    load_before: float
    load_after: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


async def run_phase(
    client: openai.AsyncOpenAI, model: str, name: str, concurrency: int, salt: str, args: argparse.Namespace
) -> Phase:
    prompts = [
        f"Here is a long list of facts about {TOPICS[i % len(TOPICS)]}:\n1." for i in range(args.requests)
    ]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    latencies: list[float] = []
    generated = 0

    async def worker() -> None:
        nonlocal generated
        while not queue.empty():
            prompt = queue.get_nowait()
            start = time.perf_counter()
            r = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=args.max_tokens,
                temperature=0,
                extra_body={"ignore_eos": True, "cache_salt": salt},
            )
            latencies.append(time.perf_counter() - start)
            assert r.usage is not None and r.usage.completion_tokens == args.max_tokens
            generated += r.usage.completion_tokens

    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    return Phase(
        name, concurrency, len(prompts), generated, seconds, latencies, load_before, os.getloadavg()[0]
    )


async def bench(url: str, args: argparse.Namespace) -> list[tuple[Phase, Phase]]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    await client.completions.create(model=model, prompt="Warm up.", max_tokens=4)
    rounds = []
    for r in range(args.rounds):
        one = await run_phase(client, model, "one by one", 1, f"one-{r}", args)
        print(f"round {r}: one by one  {one.tokens_per_s:6.2f} tokens/s ({one.seconds:.1f} s)", flush=True)
        many = await run_phase(
            client, model, f"{args.concurrency} clients", args.concurrency, f"many-{r}", args
        )
        ratio = many.tokens_per_s / one.tokens_per_s
        print(
            f"round {r}: {many.name}  {many.tokens_per_s:6.2f} tokens/s ({many.seconds:.1f} s)",
            f"ratio {ratio:.2f}",
            flush=True,
        )
        rounds.append((one, many))
    await client.close()
    return rounds


def machine() -> str:
    return (
        f"{cpu_name()}, {os.cpu_count()} CPUs; Python {platform.python_version()}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads by default); {platform.platform()}"
    )


def report(results: dict[int, list[tuple[Phase, Phase]]], args: argparse.Namespace) -> str:
    lines = [
        "# Serving throughput: one by one vs concurrent clients",
        "",
        f"Machine: {machine()}.",
        "",
        f"`kvsplice serve` (default model, Gemma 3 270M Q4_K_M run in float32; `--max-num-seqs "
        f"{args.max_num_seqs}`, `--kv-cache-gb {args.kv_cache_gb}`) in a subprocess; the `openai` "
        f"client sends {args.requests} distinct completion requests, greedy, `ignore_eos`, "
        f"{args.max_tokens} generated tokens each: first one by one, then from {args.concurrency} "
        f"concurrent clients, each phase under its own cache salt, for {args.rounds} rounds. "
        "Throughput = generated tokens / wall time of the phase. Load = the 1-minute load average "
        "before/after the phase (other work on the machine shares its CPUs).",
        "",
        f"Produced by `python bench/serve_concurrency.py "
        f"--num-threads {' '.join(map(str, args.num_threads))}` on {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "| torch threads | round | phase | requests | generated tokens | wall s | tokens/s | "
        "mean latency s | load |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    summary = []
    for threads, rounds in results.items():
        name = str(threads) if threads else "default"
        for r, phases in enumerate(rounds):
            for p in phases:
                lines.append(
                    f"| {name} | {r} | {p.name} | {p.requests} | {p.generated_tokens} | {p.seconds:.1f} | "
                    f"{p.tokens_per_s:.2f} | {statistics.mean(p.latencies):.2f} | "
                    f"{p.load_before:.1f} → {p.load_after:.1f} |"
                )
        ratios = [many.tokens_per_s / one.tokens_per_s for one, many in rounds]
        summary.append(
            f"- torch threads {name}: " + ", ".join(f"{x:.2f}" for x in ratios)
            + f" (median **{statistics.median(ratios):.2f}**)"
        )  # fmt: skip
    lines += [
        "",
        f"Throughput ratio, {args.concurrency} concurrent clients ÷ one by one (each round's phases run "
        "side by side):",
        "",
        *summary,
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument(
        "--num-threads", type=int, nargs="+", default=[1, 0], help="torch threads per run (0: default)"
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    results = {}
    for threads in args.num_threads:
        print(f"torch threads: {threads or 'default'}", flush=True)
        flags = ["--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", str(args.max_num_seqs)]
        with serve(flags + (["--num-threads", str(threads)] if threads else [])) as url:
            results[threads] = asyncio.run(bench(url, args))
    text = report(results, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
