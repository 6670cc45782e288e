"""Latency under a long prefill: 8 streaming clients decode while a ~16K-token prompt arrives.

Against a real `kvsplice serve` in a subprocess, driven by the `openai` client, with chunked prefill
(once per `--budgets` value of `--max-num-batched-tokens`; default 256, the engine's) and once
unchunked (a budget larger than the long prompt, so it is prefilled in one step, as before the
token-budget scheduler), side by side in one run. Per configuration:

1. 8 clients stream greedy completions (ignore_eos) of distinct short prompts; the inter-token
   latency (ITL) of their chunks over a few idle seconds is the baseline;
2. the long prompt arrives (max_tokens=1): its time to first token is its prefill time;
3. `--short-after` seconds later a 5-token request arrives (max_tokens=1): its TTFT;
4. the streams' ITL while the long prompt is in prefill, p50 and p99; total throughput is prompt
   plus generated tokens over the window from the long prompt's arrival to its first token.

Every request carries a cache salt of its configuration's own, so nothing is reused across them.
Run: python bench/serve_latency.py   (~6 minutes on 2 CPU cores; writes bench/results/serve_latency.md)
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import openai
import torch

from kvsplice.bench.metrics import percentile
from kvsplice.bench.results import cpu_name, load_average
from kvsplice.bench.server_process import serve
from kvsplice.loader.gguf import convert_gguf, default_model_path
from kvsplice.loader.tokenizer import Tokenizer

RESULT = Path(__file__).parent / "results" / "serve_latency.md"
STREAMS = 8


@dataclass
class Measured:
    name: str
    budget: str
    idle_itl: list[float] = field(default_factory=list)
    busy_itl: list[float] = field(default_factory=list)
    long_prefill_s: float = 0.0
    short_ttft_s: float = 0.0
    window_tokens: int = 0
    load: tuple[float, float, float] | None = None

    @property
    def throughput(self) -> float:
        return self.window_tokens / self.long_prefill_s


async def measure(url: str, m: Measured, long_ids: list[int], args: argparse.Namespace) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    salt = {"cache_salt": m.name}
    stop = asyncio.Event()
    arrivals: list[list[float]] = [[] for _ in range(STREAMS)]

    async def stream(i: int) -> None:
        response = await client.completions.create(
            model=model, prompt=f"Stream {i}: a list of rivers of the world:", max_tokens=4000,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True, **salt},
        )  # fmt: skip
        async for _ in response:
            arrivals[i].append(time.perf_counter())
            if stop.is_set():
                break
        await response.close()

    async def one(prompt: list[int] | str) -> float:
        t0 = time.perf_counter()
        await client.completions.create(
            model=model, prompt=prompt, max_tokens=1, temperature=0.0, extra_body=salt
        )
        return time.perf_counter() - t0

    streams = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
    while min(len(a) for a in arrivals) < 3:
        for task in streams:
            if task.done():
                task.result()  # a stream that ended early raises its error here
        await asyncio.sleep(0.05)
    idle_start = time.perf_counter()
    await asyncio.sleep(args.idle_s)
    long_start = time.perf_counter()
    long_task = asyncio.create_task(one(long_ids))
    await asyncio.sleep(args.short_after)
    m.short_ttft_s = await one("Hello there")
    m.long_prefill_s = await long_task
    long_end = long_start + m.long_prefill_s
    stop.set()
    await asyncio.gather(*streams)
    for times in arrivals:
        for a, b in itertools.pairwise(times):
            if idle_start <= a and b <= long_start:
                m.idle_itl.append(b - a)
            elif long_start <= a and b <= long_end:
                m.busy_itl.append(b - a)
    generated = sum(1 for times in arrivals for t in times if long_start <= t <= long_end)
    m.window_tokens = len(long_ids) + generated + 2


def run(name: str, extra: list[str], long_ids: list[int], args: argparse.Namespace) -> Measured:
    m = Measured(name, " ".join(extra) or "default")
    flags = ["--kv-cache-gb", str(args.kv_cache_gb), "--num-threads", str(args.num_threads), *extra]
    with serve(flags) as url:
        asyncio.run(measure(url, m, long_ids, args))
    m.load = load_average()
    return m


def report(rows: list[Measured], args: argparse.Namespace, prompt_tokens: int) -> str:
    lines = [
        "# Latency under a long prefill: chunked vs unchunked",
        "",
        f"Command: `python bench/serve_latency.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"Machine: {cpu_name()}, {os.cpu_count()} CPUs; Python {platform.python_version()}, "
        f"torch {torch.__version__}; server with {args.num_threads} torch thread(s); default model.",
        f"{STREAMS} streaming clients; a {prompt_tokens}-token prompt arrives after {args.idle_s:g} s of "
        f"idle decoding, a 5-token request {args.short_after:g} s after it. Load average after each run "
        "is listed: other processes on the machine slow both alike only roughly.",
        "",
        "| configuration | budget | idle ITL p50 | ITL p50 during prefill | ITL p99 during prefill "
        "| p99 / idle p50 | short request TTFT | long prefill | throughput (tokens/s) | load after |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for m in rows:
        idle = statistics.median(m.idle_itl)
        p50, p99 = percentile(m.busy_itl, 50), percentile(m.busy_itl, 99)
        lines.append(
            f"| {m.name} | `{m.budget}` | {idle * 1000:.0f} ms | {p50 * 1000:.0f} ms | {p99 * 1000:.0f} ms "
            f"| {p99 / idle:.1f}x | {m.short_ttft_s:.2f} s | {m.long_prefill_s:.1f} s | {m.throughput:.0f} "
            f"| {m.load} |"
        )
    whole = rows[-1]
    lines += [""]
    for m in rows[:-1]:
        lines.append(
            f"Long prefill, {m.name} / unchunked: {m.long_prefill_s / whole.long_prefill_s:.2f}x "
            "(a chunked prefill shares its steps with the 8 streams' decode tokens)."
        )
    lines += [""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--idle-s", type=float, default=4.0)
    parser.add_argument("--short-after", type=float, default=3.0)
    parser.add_argument("--num-threads", type=int, default=1)
    # 8 streams reserve prompt + max_tokens (4,000) each, the long prompt 16K: 2.5 GiB holds ~70K tokens.
    parser.add_argument("--kv-cache-gb", type=float, default=2.5)
    parser.add_argument(
        "--budgets", type=int, nargs="+", default=[256], help="max_num_batched_tokens of the chunked runs"
    )
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_dir(convert_gguf(default_model_path()))
    text = (resources.files("kvsplice") / "data" / "segment_context.txt").read_text()
    ids = tokenizer.encode(text)
    long_ids = [tokenizer.bos_token_id or 2, *(ids * (1 + args.prompt_tokens // len(ids)))][
        : args.prompt_tokens
    ]
    whole = str(args.prompt_tokens + 64)
    rows = [run(f"chunked {b}", ["--max-num-batched-tokens", str(b)], long_ids, args) for b in args.budgets]
    rows.append(
        run("unchunked", ["--max-num-batched-tokens", whole, "--long-prefill-token-threshold", whole],
            long_ids, args)
    )  # fmt: skip
    text = report(rows, args, len(long_ids))
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
