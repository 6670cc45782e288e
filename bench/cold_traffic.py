"""Cold traffic: do new documents cost one prefill, and does store work delay anyone? (issue 14)

Against real `kvsplice serve` processes (one per system), driven by the `openai` client:

    off      no prefix cache, documents as plain text
    radix    SGLang-style radix prefix cache, documents as plain text
    splice   radix + documents as segments (`{"segment": ...}` prompt parts), default repair

Two streams per system, each request carrying `--docs` MuSiQue passages and a question:
  all-new      every document is one no earlier request carried;
  half-recur   half of each request's documents come from the all-new stream (in a new order), half
               are new.
Each stream is sent back to back by one client, then (under a fresh cache salt, so nothing is
shared with the first pass) by `--clients` concurrent clients, in rounds of that many requests.
The three servers run at once and take turns, request by request with one client and round by
round with several, each system first as often as the others: run one after another, the systems
met different loads on this shared 2-core machine, which moved the ratios by more than the effects
measured (bench/results/cold_traffic.md). An idle server costs nothing.
Per system and stream: prompt tokens computed per prompt token (from the usage extension: prompt -
prefix hits - segment hits + recomputed), throughput (prompt tokens per second of the system's own
wall time) and TTFT p50/p99 (first streamed token).

Then, per system: a cold request (new documents, max_tokens=1) and, the moment it has answered, a
request with the same documents reordered, against such a request sent to an idle engine: what
work done after a cold request's first token (storing its segments) costs the next request (the
target: within 10 %). `--requests 0` runs only this part.

Run: python bench/cold_traffic.py   (about 45 minutes on 2 CPU cores, 20 with --requests 4 --pairs 2;
writes bench/results/cold_traffic.md)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai
import torch

from kvsplice.bench import corpus
from kvsplice.bench.metrics import percentile
from kvsplice.bench.results import cpu_name, load_average
from kvsplice.bench.server_process import serve

RESULT = Path(__file__).parent / "results" / "cold_traffic.md"
# The baselines find no spans in plain prompts (auto_segments off): they are the prefix caches alone.
SYSTEMS = {
    "off": ["--prefix-cache", "off", "--no-auto-segments"],
    "radix": ["--prefix-cache", "radix", "--no-auto-segments"],
    "splice": ["--prefix-cache", "radix"],
}
INSTRUCTION = "Read the documents below and answer the question.\n\n"
QUESTION = "Question: Which of the documents above is the oldest?\nAnswer:"


@dataclass
class Sent:
    ttft_s: float
    prompt_tokens: int
    computed_tokens: int


@dataclass
class Stream:
    system: str
    stream: str
    clients: int
    wall_s: float = 0.0
    sent: list[Sent] = field(default_factory=list)

    @property
    def computed_share(self) -> float:
        return sum(s.computed_tokens for s in self.sent) / sum(s.prompt_tokens for s in self.sent)

    @property
    def throughput(self) -> float:
        return sum(s.prompt_tokens for s in self.sent) / self.wall_s

    def ttft(self, q: float) -> float:
        value = percentile([s.ttft_s for s in self.sent], q)
        assert value is not None, "a stream sends at least one request"
        return value


def prompt(system: str, docs: list[str]) -> str | list[dict[str, str]]:
    if system != "splice":
        return INSTRUCTION + "".join(d + "\n\n" for d in docs) + QUESTION
    parts = [{"text": INSTRUCTION}]
    for doc in docs:
        parts += [{"segment": doc}, {"text": "\n\n"}]
    return [*parts, {"text": QUESTION}]


def workload(args: argparse.Namespace) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """The all-new stream, the half-recurring stream and the documents of the after-cold pairs."""
    rng = random.Random(args.seed)
    passages = [p for p in corpus.load("auto").passages if len(p.text.split()) >= 60]
    texts = [f"{p.title}\n{corpus.trim(p.text, args.doc_words)}" for p in rng.sample(passages, len(passages))]
    k, n = args.docs, args.requests
    need = n * k + n * (k - k // 2) + args.pairs * k
    assert len(texts) >= need, f"the corpus has {len(texts)} passages, the run needs {need}"
    fresh = iter(texts)
    new = [[next(fresh) for _ in range(k)] for _ in range(n)]
    seen = [d for request in new for d in request]
    half = []
    for _ in range(n):
        docs = rng.sample(seen, k // 2) + [next(fresh) for _ in range(k - k // 2)]
        rng.shuffle(docs)
        half.append(docs)
    pairs = [[next(fresh) for _ in range(k)] for _ in range(args.pairs)]
    return new, half, pairs


async def send(
    client: openai.AsyncOpenAI, model: str, system: str, docs: list[str], salt: str, max_tokens: int
) -> Sent:
    t0 = time.perf_counter()
    ttft, usage = None, None
    response = await client.completions.create(
        model=model, prompt=prompt(system, docs), max_tokens=max_tokens, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"cache_salt": salt, "ignore_eos": True},
    )  # fmt: skip
    async for chunk in response:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    assert ttft is not None and usage is not None
    reused = usage.get("prefix_hit_tokens", 0) + usage.get("segment_hit_tokens", 0)
    computed = usage["prompt_tokens"] - reused + usage.get("recomputed_tokens", 0)
    return Sent(ttft, usage["prompt_tokens"], computed)


def rotated(systems: list[str], turn: int) -> list[str]:
    """The systems in the order they go on this turn: each goes first as often as the others."""
    k = turn % len(systems)
    return systems[k:] + systems[:k]


async def run_stream(
    clients: dict[str, openai.AsyncOpenAI], models: dict[str, str], name: str, requests: list[list[str]],
    concurrency: int, max_tokens: int,
) -> list[Stream]:  # fmt: skip
    """Every system sends `requests`, `concurrency` at a time; the systems take turns round by round."""
    streams = {system: Stream(system, name, concurrency) for system in clients}
    for turn, first in enumerate(range(0, len(requests), concurrency)):
        for system in rotated(list(clients), turn):
            salt = f"{system}-{concurrency}"
            t0 = time.perf_counter()
            sent = await asyncio.gather(
                *(send(clients[system], models[system], system, docs, salt, max_tokens)
                  for docs in requests[first : first + concurrency])
            )  # fmt: skip
            streams[system].wall_s += time.perf_counter() - t0
            streams[system].sent += sent
    return list(streams.values())


async def after_cold(
    clients: dict[str, openai.AsyncOpenAI], models: dict[str, str], pairs: list[list[str]]
) -> dict[str, tuple[float, float]]:
    """Per system, the median TTFT of a reordered request sent the moment a cold request
    (max_tokens=1) with the same documents has answered, and of the same kind of request sent to an
    idle engine: what the cold request's store work costs the next one. Systems take turns pair by pair."""
    after: dict[str, list[float]] = {system: [] for system in clients}
    idle: dict[str, list[float]] = {system: [] for system in clients}
    for i, docs in enumerate(pairs):
        for system in rotated(list(clients), i):
            client, model, salt = clients[system], models[system], f"{system}-pairs-{i}"
            await send(client, model, system, docs, salt, 1)
            after[system].append((await send(client, model, system, docs[::-1], salt, 1)).ttft_s)
            await asyncio.sleep(2.0)
            order = docs[1:] + docs[:1]
            idle[system].append((await send(client, model, system, order, salt, 1)).ttft_s)
    return {s: (statistics.median(after[s]), statistics.median(idle[s])) for s in clients}


Docs = list[list[str]]


async def bench(
    urls: dict[str, str], args: argparse.Namespace, new: Docs, half: Docs, pairs: Docs
) -> tuple[list[Stream], dict[str, tuple[float, float]]]:
    clients = {
        system: openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
        for system, url in urls.items()
    }
    models = {system: (await client.models.list()).data[0].id for system, client in clients.items()}
    streams = []
    for concurrency in (1, args.clients) if args.requests else ():
        streams += await run_stream(clients, models, "all-new", new, concurrency, args.max_tokens)
        streams += await run_stream(clients, models, "half-recur", half, concurrency, args.max_tokens)
        print(f"{concurrency} client(s) done", flush=True)
    return streams, await after_cold(clients, models, pairs)


def report(
    streams: list[Stream],
    pairs: dict[str, tuple[float, float]],
    args: argparse.Namespace,
    loads: list[object],
) -> str:
    lines = [
        "# Cold traffic: off, radix and splice side by side",
        "",
        f"Command: `python bench/cold_traffic.py {' '.join(sys.argv[1:])}`".rstrip(),
        f"Machine: {cpu_name()}, {os.cpu_count()} CPUs; Python {platform.python_version()}, torch "
        f"{torch.__version__}; each server with {args.num_threads} torch thread(s); default model; "
        f"default repair; the three servers run at once and take turns. Load average at the start "
        f"and the end: {loads}.",
        f"{args.requests} requests per stream, {args.docs} MuSiQue passages of at most "
        f"{args.doc_words} words each, max_tokens={args.max_tokens}.",
        "",
        "| stream | clients | system | computed / prompt tokens | throughput (prompt tokens/s) | vs radix "
        "| TTFT p50 | TTFT p99 | TTFT p50 vs radix |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(s.stream, s.clients, s.system): s for s in streams}
    for s in streams:
        if s.system != "off":
            continue
        for system in SYSTEMS:
            row = by_key[(s.stream, s.clients, system)]
            radix = by_key[(s.stream, s.clients, "radix")]
            lines.append(
                f"| {s.stream} | {s.clients} | {system} | {row.computed_share:.2f} | {row.throughput:.0f} "
                f"| {row.throughput / radix.throughput:.2f}x | {row.ttft(50):.2f} s "
                f"| {row.ttft(99):.2f} s | {row.ttft(50) / radix.ttft(50):.2f}x |"
            )
    lines += [
        "",
        "A request with the documents of a cold request (max_tokens=1), reordered, sent the moment the "
        f"cold one has answered, and on an idle engine (median TTFT over {args.pairs} pairs):",
        "",
        "| system | right after the cold request | on an idle engine | ratio |",
        "|---|---:|---:|---:|",
    ]
    for system, (busy, idle) in pairs.items():
        lines.append(f"| {system} | {busy:.2f} s | {idle:.2f} s | {busy / idle:.2f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--docs", type=int, default=6)
    parser.add_argument("--doc-words", type=int, default=180)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--kv-cache-gb", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    new, half, pairs = workload(args)
    common = ["--kv-cache-gb", str(args.kv_cache_gb), "--num-threads", str(args.num_threads)]
    with contextlib.ExitStack() as servers:
        urls = {system: servers.enter_context(serve([*flags, *common])) for system, flags in SYSTEMS.items()}
        loads = [load_average()]
        streams, after = asyncio.run(bench(urls, args, new, half, pairs))
        loads.append(load_average())
    text = report(streams, after, args, loads)
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
