"""Lookup and insert throughput of the two prefix indexes (vLLM hash chain, SGLang radix tree).

Both caches are filled, through the engine's interface, with about 100K blocks of 16 tokens
(1.6M tokens): 64 groups share a 1024-token prefix, and each cached sequence adds 1024 tokens of
its own. Then each operation is timed on prompts generated beforehand, each lookup on a cached
sequence of its own (so a radix split is paid every time it applies):

- lookup = `acquire` (for the hash chain this includes hashing the prompt's blocks up to the
  first miss; the rest are hashed when they are indexed, under insert);
- insert = `on_computed` + `release` of a request that hit the 1024-token group prefix and
  computed 1024 new tokens (the hash chain hashes and registers 64 blocks at on_computed; the
  radix tree inserts 1024 tokens at release and drops the request's references).

Each row is run `--repeats` times on fresh prompts and the fastest run is kept (as timeit does:
the others measure the machine's other load). Both indexes run in one process, one after the other.

Run: python bench/prefix_index_throughput.py   (about a minute; writes bench/results/...md)
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvsplice.bench.results import cpu_name, load_average
from kvsplice.cache.base import CacheSeq, PrefixCache
from kvsplice.cache.hash_chain import HashChainCache
from kvsplice.cache.registry import make_prefix_cache
from kvsplice.kv.allocator import BlockAllocator

VOCAB = 32000  # cached tokens are drawn below this; "fresh" tokens above, so they never match
GROUPS = 64
PREFIX_TOKENS = 1024
OWN_TOKENS = 1024
RESULT = Path(__file__).parent / "results" / "prefix_index_throughput.md"


@dataclass(frozen=True)
class Timing:
    index: str
    op: str
    prompt_tokens: int
    hit_tokens: int
    ops: int
    seconds: float  # the fastest repeat

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds

    @property
    def us_per_op(self) -> float:
        return 1e6 * self.seconds / self.ops


class Workload:
    """The cached sequences and, per timed row, `repeats` disjoint lists of `num_ops` prompts."""

    def __init__(self, target_blocks: int, block_size: int, num_ops: int, repeats: int, seed: int) -> None:
        self._rng = random.Random(seed)
        own_blocks = OWN_TOKENS // block_size
        num_seqs = -(-(target_blocks - GROUPS * PREFIX_TOKENS // block_size) // own_blocks)
        assert num_ops * repeats <= num_seqs, "each timed lookup needs a cached sequence of its own"
        self.prefixes = [self.cached(PREFIX_TOKENS) for _ in range(GROUPS)]
        self.sequences = [self.prefixes[i % GROUPS] + self.cached(OWN_TOKENS) for i in range(num_seqs)]
        picks = self._rng.sample(range(num_seqs), num_ops * repeats)
        runs = [picks[r * num_ops : (r + 1) * num_ops] for r in range(repeats)]
        length = PREFIX_TOKENS + OWN_TOKENS
        mid = PREFIX_TOKENS + 476  # not a block boundary: the radix match ends inside a block
        self.lookups: dict[str, list[list[list[int]]]] = {
            "lookup: whole sequence": [[self.sequences[i] + self.fresh(1) for i in run] for run in runs],
            "lookup: group prefix": [
                [self.prefixes[i % GROUPS] + self.fresh(OWN_TOKENS) for i in run] for run in runs
            ],
            "lookup: mid-block": [
                [self.sequences[i][:mid] + self.fresh(length - mid) for i in run] for run in runs
            ],
            "lookup: miss": [[self.fresh(length) for _ in run] for run in runs],
        }
        self.inserts = [[self.prefixes[i % GROUPS] + self.fresh(OWN_TOKENS) for i in run] for run in runs]

    def cached(self, n: int) -> list[int]:
        return [self._rng.randrange(VOCAB) for _ in range(n)]

    def fresh(self, n: int) -> list[int]:
        return [VOCAB + self._rng.randrange(VOCAB) for _ in range(n)]


class Driver:
    """Plays the engine's part around one cache (no KV is written, so a partial hit block is kept)."""

    def __init__(self, name: str, num_blocks: int, block_size: int) -> None:
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.cache: PrefixCache = make_prefix_cache(name, self.alloc)
        self.block_size = block_size
        self._ids = 0

    def admit(self, tokens: list[int]) -> CacheSeq:
        self._ids += 1
        seq = CacheSeq(f"r{self._ids}", 0, tokens)
        hit = self.cache.acquire(seq)
        seq.block_table = list(hit.blocks)
        seq.num_computed = hit.num_tokens
        return seq

    def compute(self, seq: CacheSeq) -> None:
        num_blocks = -(-len(seq.keys) // self.block_size)
        seq.block_table += self.alloc.allocate(num_blocks - len(seq.block_table))
        seq.num_computed = len(seq.keys)

    def run(self, tokens: list[int]) -> None:
        seq = self.admit(tokens)
        self.compute(seq)
        self.cache.on_computed(seq)
        self.cache.release(seq)


def timed(fn: Callable[[], object]) -> float:
    gc.collect()
    gc.disable()  # as timeit does: collector pauses are noise at this scale
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def bench_index(name: str, work: Workload, num_blocks: int, block_size: int) -> tuple[list[Timing], str]:
    driver = Driver(name, num_blocks, block_size)
    cache = driver.cache

    def build() -> None:
        for tokens in work.sequences:
            driver.run(tokens)

    seconds = timed(build)
    # The radix tree holds a reference on what it caches; the hash chain's cached blocks are free.
    cached = cache.num_cached_blocks if isinstance(cache, HashChainCache) else driver.alloc.num_used
    note = f"{name}: {cached} cached blocks, built from {len(work.sequences)} sequences in {seconds:.1f} s"
    timings = []
    for op, runs in work.lookups.items():
        best, hits = float("inf"), set()
        for prompts in runs:
            held: list[CacheSeq] = []

            def lookup_all(prompts: list[list[int]] = prompts, held: list[CacheSeq] = held) -> None:
                for tokens in prompts:
                    held.append(driver.admit(tokens))

            best = min(best, timed(lookup_all))
            hits |= {seq.num_computed for seq in held}
            for seq in held:
                cache.release(seq)
        assert len(hits) == 1, f"{op}: the hits vary: {sorted(hits)[:5]}"
        timings.append(Timing(name, op, len(runs[0][0]), hits.pop(), len(runs[0]), best))
    best = float("inf")
    for prompts in work.inserts:
        computed = []
        for tokens in prompts:
            seq = driver.admit(tokens)
            driver.compute(seq)
            computed.append(seq)

        def insert_all(computed: list[CacheSeq] = computed) -> None:
            for seq in computed:
                cache.on_computed(seq)
                cache.release(seq)

        best = min(best, timed(insert_all))
    op = f"insert: {OWN_TOKENS} new tokens"
    timings.append(Timing(name, op, len(work.inserts[0][0]), PREFIX_TOKENS, len(work.inserts[0]), best))
    driver.alloc.check_invariants()
    return timings, note


def machine() -> str:
    python = f"Python {platform.python_version()} ({platform.python_implementation()})"
    load = load_average()
    return f"{cpu_name()}, {os.cpu_count()} CPUs (load average {load}); {python}; {platform.platform()}"


def report(timings: list[Timing], notes: list[str], args: argparse.Namespace) -> str:
    lines = [
        "# Prefix index throughput",
        "",
        f"Machine: {machine()}.",
        "",
        f"Cache: ~{args.blocks} blocks of {args.block_size} tokens. {args.ops} operations per row,",
        f"fastest of {args.repeats} runs on fresh prompts, one thread, garbage collector paused",
        "while timing.",
        "Lookup = `acquire`; insert = `on_computed` + `release` (see the script's docstring).",
        "Produced by `python bench/prefix_index_throughput.py`.",
        "",
        *[f"- {note}" for note in notes],
        "",
        "| index | operation | prompt tokens | hit tokens | ops/s | µs/op |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for t in timings:
        cells = [t.index, t.op, t.prompt_tokens, t.hit_tokens, f"{t.ops_per_s:,.0f}", f"{t.us_per_op:,.1f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += ["", "Side by side (radix ops/s ÷ hash ops/s, same run):", ""]
    lines += ["| operation | radix ÷ hash |", "|---|---:|"]
    by_key = {(t.index, t.op): t for t in timings}
    for t in timings:
        if t.index == "hash":
            lines.append(f"| {t.op} | {by_key['radix', t.op].ops_per_s / t.ops_per_s:.2f}× |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="cached blocks to build")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ops", type=int, default=250, help="timed operations per run of a row")
    parser.add_argument("--repeats", type=int, default=5, help="runs per row; the fastest is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    work = Workload(args.blocks, args.block_size, args.ops, args.repeats, args.seed)
    # Room for the cache plus every timed insert, so timing never pays for evictions.
    num_blocks = args.blocks + args.repeats * args.ops * OWN_TOKENS // args.block_size + 1024
    timings, notes = [], []
    for name in ("hash", "radix"):
        rows, note = bench_index(name, work, num_blocks, args.block_size)
        timings += rows
        notes.append(note)
    text = report(timings, notes, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
