"""Load a segment's KV from each store tier vs recompute it, side by side, on the default model.

For segments of 256, 1K and 4K tokens: the time to get the segment's KV back from memory (a copy
into pool-shaped tensors: what promoting any hit costs, and all an in-pool hit costs), from RAM
bytes (verify + decode: the entry format alone), from the disk tier (page cache warm, and cold:
the file dropped from the page cache first) and from a local redis-server, against the time the
default model takes to compute it (a prefill of the segment after the cached canonical context,
through kvsplice's LLM, one thread). Entries are written in three ways: float32, float16, and
float16 with the sliding-window layers keeping only their last `window` tokens.

    python bench/store_tiers.py [--lengths 256 1024 4096] [--reps 5] [--out FILE]

Needs redis-server on PATH (started here on a free localhost port) or --redis-url.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from kvsplice import LLM, SamplingParams
from kvsplice.bench.results import cpu_name, load_average
from kvsplice.bench.server_process import redis_server
from kvsplice.loader.gguf import convert_gguf, default_model_path
from kvsplice.tiers import (
    DiskTier,
    KVFingerprint,
    RedisTier,
    SegmentKV,
    TieredStore,
    decode_entry,
    encode_entry,
    entry_key,
)
from kvsplice.tiers.breaker import CircuitBreaker

TARGET = 0.25  # a disk or Redis hit of a 1K-token segment should cost at most this share of a recompute


@dataclass(frozen=True)
class Layout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding: tuple[bool, ...]
    window: int | None


@dataclass(frozen=True)
class Variant:
    name: str
    store_dtype: str
    trim_sliding: bool


VARIANTS = (
    Variant("float32", "float32", False),
    Variant("float16", "float16", False),
    Variant("float16, sliding layers last window", "float16", True),
)


def read_layout(model_dir: Path) -> Layout:
    raw = json.loads((model_dir / "config.json").read_text())
    types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    return Layout(
        num_layers=raw["num_hidden_layers"],
        num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        sliding=tuple(t == "sliding_attention" for t in types),
        window=raw.get("sliding_window"),
    )


def median_s(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def recompute_s(llm: LLM, context: list[int], length: int, reps: int, rng: random.Random) -> float:
    """Median time to first token of context + a fresh segment, the context's KV cached."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([context], params)  # the context's KV enters the prefix cache
    times = []
    for _ in range(reps):
        segment = [rng.randrange(1000, 200_000) for _ in range(length)]
        out = llm.generate([context + segment], params)[0]
        assert out.metrics.prefix_hit_tokens >= len(context) - 16, "the context was not reused"
        times.append(out.metrics.ttft_s)
    return statistics.median(times)


def fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each load (median)")
    parser.add_argument("--recompute-reps", type=int, default=3)
    parser.add_argument("--context", type=int, default=576, help="canonical context tokens before a segment")
    parser.add_argument("--redis-url", default=None, help="default: start redis-server on a free port")
    parser.add_argument("--out", type=Path, default=Path("bench/results/store_tiers.md"))
    args = parser.parse_args()
    if len(set(args.lengths)) < 2:
        parser.error("--lengths needs two lengths or more: the break-even is a line fitted through them")
    torch.set_num_threads(1)
    rng = random.Random(0)

    load_start = load_average()
    model_dir = convert_gguf(default_model_path())
    layout = read_layout(model_dir)
    llm = LLM(num_threads=1, prefix_cache="radix", kv_cache_gb=2.0)
    context = [rng.randrange(1000, 200_000) for _ in range(args.context)]
    recompute = {n: recompute_s(llm, context, n, args.recompute_reps, rng) for n in args.lengths}
    del llm

    fp = KVFingerprint(
        "bench-weights", "bench-tokenizer", "float32", "float32", layout.num_layers,
        layout.num_kv_heads, layout.head_dim, "bench", tuple(context), "prompt",
    )  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="kvsplice-bench-store-"))
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        redis_url = args.redis_url or stack.enter_context(redis_server(tmp))
        disk = DiskTier(tmp / "disk", 64 * 2**30)
        remote = RedisTier(redis_url, ttl_s=None, timeout_s=5.0, breaker=CircuitBreaker(3, 5.0))
        stack.callback(remote.close)
        for n in args.lengths:
            rows += measure(n, fp, layout, disk, remote, args.reps, recompute[n], rng)
    write_report(args, rows, layout, load_start)


@dataclass(frozen=True)
class Row:
    tokens: int
    variant: str
    entry_mb: float
    # Seconds.
    recompute: float
    memory: float
    ram: float
    disk: float
    disk_cold: float
    redis: float
    encode: float


def pool_copy(pool_k: torch.Tensor, pool_v: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:  # fmt: skip
    """k, v: [layers, tokens, kv_heads, head_dim] into pool_k, pool_v: [layers, slots, kv_heads, head_dim]."""
    pool_k[:, slots] = k
    pool_v[:, slots] = v


def cold_disk_get(disk: DiskTier, fp: KVFingerprint, salt: str, tokens: list[int], reps: int) -> float:
    """Median get of an entry dropped from the page cache before each read."""
    path = disk.directory / f"{entry_key(fp, salt, tokens)}.kv"
    times = []
    for _ in range(reps):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        start = time.perf_counter()
        assert TieredStore(fp, [disk]).get(salt, tokens) is not None
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    n: int, fp: KVFingerprint, layout: Layout, disk: DiskTier, remote: RedisTier, reps: int,
    recompute: float, rng: random.Random,
) -> list[Row]:  # fmt: skip
    g = torch.Generator().manual_seed(n)
    shape = (layout.num_layers, n, layout.num_kv_heads, layout.head_dim)
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    tokens = [rng.randrange(1000, 200_000) for _ in range(n)]
    # The segment lands in scattered slots of a pool twice its size.
    pool_k = torch.zeros(layout.num_layers, 2 * n + 64, layout.num_kv_heads, layout.head_dim)
    slots = torch.randperm(2 * n + 64, generator=g)[:n]
    memory = median_s(partial(pool_copy, pool_k, torch.zeros_like(pool_k), slots, k, v), reps)
    rows = []
    for variant in VARIANTS:
        trim = variant.trim_sliding and layout.window is not None
        spans = [
            (max(0, n - (layout.window or n)), n) if trim and sliding else (0, n)
            for sliding in layout.sliding
        ]
        kv = SegmentKV.select(k, v, spans)
        salt = variant.name  # one entry per variant
        data = encode_entry(fp, salt, tokens, kv, variant.store_dtype)
        loads = {}
        for tier in (disk, remote):
            store = TieredStore(fp, [tier], store_dtype=variant.store_dtype)
            store.put(salt, tokens, kv)
            assert store.flush(120) and store.get(salt, tokens) is not None, f"{tier.name}: no hit"
            loads[tier.name] = median_s(partial(store.get, salt, tokens), reps)
        rows.append(
            Row(
                tokens=n,
                variant=variant.name,
                entry_mb=len(data) / 1e6,
                recompute=recompute,
                memory=memory,
                ram=median_s(partial(decode_entry, bytes(data), fp, salt, tokens), reps),
                disk=loads["disk"],
                disk_cold=cold_disk_get(disk, fp, salt, tokens, reps),
                redis=loads["redis"],
                encode=median_s(partial(encode_entry, fp, salt, tokens, kv, variant.store_dtype), reps),
            )
        )
        print(rows[-1], flush=True)
        disk.delete(entry_key(fp, salt, tokens))
        remote.delete(entry_key(fp, salt, tokens))
    return rows


def ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f}"


def write_report(
    args: argparse.Namespace, rows: list[Row], layout: Layout, load_start: tuple[float, float, float] | None
) -> None:
    lengths = sorted({r.tokens for r in rows})
    command = f"python bench/store_tiers.py --lengths {' '.join(map(str, args.lengths))} --reps {args.reps}"
    lines = [
        "# Store tiers: load a segment's KV vs recompute it",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__}, 1 thread, "
        f"Python {platform.python_version()}, load average {load_start} at the start, "
        f"{load_average()} at the end (the machine is shared: both sides of each ratio are measured "
        "in the same run). Default model (Gemma 3 270M): "
        f"KV of {layout.num_layers} layers x {layout.num_kv_heads} KV head x {layout.head_dim}, "
        f"{sum(layout.sliding)} sliding-window layers (window {layout.window}). Redis: a local redis-server "
        "over TCP loopback. Medians; times in milliseconds.",
        "",
        "Recompute: time to first token of a prefill of the segment after the cached canonical context "
        f"({args.context} tokens), through kvsplice's LLM. memory: copying the segment's KV into pool slots "
        "(what promoting any hit costs; an in-pool hit costs nothing more). RAM: verify + decode of an entry "
        "already in memory (the format alone). disk: page cache warm; disk cold: the file dropped from the "
        "page cache first (posix_fadvise). Each tier time is a whole `TieredStore.get`: read, blake2b "
        "digest, header check, decode to float32. encode runs in the background writer, not on the "
        "request path.",
        "",
        "| tokens | stored as | entry MB | recompute | memory | RAM | disk | disk cold | redis "
        "| disk cold / recompute | redis / recompute | encode |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [str(r.tokens), r.variant, f"{r.entry_mb:.1f}", f"{1e3 * r.recompute:.0f}", ms(r.memory),
                 ms(r.ram), ms(r.disk), ms(r.disk_cold), ms(r.redis), f"{r.disk_cold / r.recompute:.1%}",
                 f"{r.redis / r.recompute:.1%}", ms(r.encode)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    # Recompute grows at least linearly (attention is quadratic), so its per-token rate at the shortest
    # length bounds it from below at shorter lengths; a load is about linear: a fixed cost plus a rate.
    shortest = lengths[0]
    rate = next(r.recompute for r in rows if r.tokens == shortest) / shortest
    lines += [
        "",
        f"Break-even: recompute costs at least {1e3 * rate:.1f} ms/token below {shortest} tokens (its rate "
        f"at {shortest}); each load, fitted as a fixed cost + a rate, pays for segments longer than:",
        "",
    ]
    for variant in VARIANTS:
        for tier in ("disk_cold", "redis"):
            ys = [
                getattr(r, tier) for n in lengths for r in rows if r.tokens == n and r.variant == variant.name
            ]
            a, b = fit(lengths, ys)
            pays = "never" if b >= rate else f"{max(a, 0.0) / (rate - b):.0f} tokens"
            lines.append(
                f"- {variant.name}, {tier.replace('_', ' ')}: "
                f"{1e3 * a:.1f} ms + {1e3 * b:.3f} ms/token: {pays}"
            )
    k1 = [r for r in rows if r.tokens == 1024]
    if k1:
        worst = max(max(r.disk_cold, r.redis) / r.recompute for r in k1)
        verdict = "met" if worst <= TARGET else "NOT met"
        target = f"a disk or Redis hit of a 1K-token segment <= {TARGET:.0%} of recomputing it"
        lines += ["", f"Target ({target}): {verdict}; worst case {worst:.1%}."]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
