"""What storing segments' KV in a smaller dtype on the disk tier costs in output fidelity (issue 13).

Per stored dtype (float32, float16, bfloat16): an engine with a disk tier in that dtype runs the
recall workload's warm-up requests (their segments are written through to disk) and is closed; a
fresh engine on the same directory (a restart: its pool is empty, so every segment is loaded from
disk) runs the measured requests. Its first-token distribution is compared with that of the writer
engine before it closed, which answered the same requests from its in-memory store (float32, the
pool's dtype): KL, top-1 agreement, the greedy continuation, and the entry bytes per token on disk.
float32 on disk is the control: it must be exact (KL 0), or the disk path itself changes the KV.

Run: python bench/store_fidelity.py   (writes bench/results/store_fidelity.md; ~10 minutes)
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvsplice.bench.base import WorkloadSpec
from kvsplice.bench.metrics import KL_CLOSE, close_rate, top1_agree
from kvsplice.bench.results import cpu_name, load_average
from kvsplice.bench.systems import System, prompt_parts
from kvsplice.bench.workloads import make_workload
from kvsplice.llm import LLM
from kvsplice.options import RequestOptions
from kvsplice.sampling import SamplingParams, kl_divergence

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Row:
    dtype: str
    # Bytes of the directory's entries over the tokens of the segments they hold.
    bytes_per_token: float
    # Segment tokens the restarted engine loaded from disk.
    loaded_tokens: int
    kls: list[float]
    top1: float
    same: float


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=12, help="measured recall requests (8 documents)")
    parser.add_argument("--tokens", type=int, default=8, help="greedy continuation compared")
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("bench/results/store_fidelity.md"))
    args = parser.parse_args(argv)
    load_start, t0 = load_average(), time.perf_counter()
    workload = make_workload("recall", WorkloadSpec(requests=args.requests, doc_counts=(8,)))
    system = System("splice:query@15", "radix", policy="query", budget_pct=15)
    warm = [prompt_parts(system, r) for r in workload.requests if r.warmup]
    measured = [prompt_parts(system, r) for r in workload.measured]
    docs = {d.text for r in workload.requests if r.warmup for d in r.docs}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, return_first_logits=True)
    options = RequestOptions(repair="query", recompute_ratio=0.15)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for dtype in DTYPES:
            directory = Path(root) / dtype
            writer = _engine(args, directory, dtype)
            segment_tokens = sum(len(writer.tokenizer.encode(d)) for d in docs)
            writer.generate(warm, params, options)
            memory = writer.generate(measured, params, options)
            writer.close()  # waits for the write-through of every segment
            del writer
            gc.collect()
            stored = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            reader = _engine(args, directory, None)
            disk = reader.generate(measured, params, options)
            reader.close()
            del reader
            gc.collect()
            pairs = list(zip(memory, disk, strict=True))
            assert all(m.first_logits is not None and d.first_logits is not None for m, d in pairs)
            rows.append(
                Row(
                    dtype,
                    stored / segment_tokens,
                    sum(d.metrics.store_hit_tokens.get("disk", 0) for d in disk),
                    [kl_divergence(m.first_logits, d.first_logits) for m, d in pairs],  # type: ignore[arg-type]
                    _share(top1_agree(m.first_logits, d.first_logits) for m, d in pairs),  # type: ignore[arg-type]
                    _share(m.token_ids == d.token_ids for m, d in pairs),
                )
            )
            print(f"{dtype}: KL mean {sum(rows[-1].kls) / len(pairs):.3g}", flush=True)
    _write(args, rows, len(measured), load_start, time.perf_counter() - t0)


def _engine(args: argparse.Namespace, directory: Path, dtype: str | None) -> LLM:
    return LLM(
        args.model,
        num_threads=args.num_threads,
        kv_cache_gb=2.0,
        store_dir=str(directory),
        store_dtype=dtype,
    )


def _share(flags: Iterable[bool]) -> float:
    values = list(flags)
    return sum(values) / len(values)


def _write(
    args: argparse.Namespace, rows: list[Row], requests: int, load_start: object, wall_s: float
) -> None:
    lines = [
        "# Store fidelity: KV stored in a smaller dtype on the disk tier",
        "",
        f"Command: `python bench/store_fidelity.py --requests {args.requests}`"
        + (f" `--model {args.model}`" if args.model else ""),
        "",
        f"Machine: {cpu_name()}, torch {torch.__version__}, {args.num_threads} thread(s), Python "
        f"{platform.python_version()}, load average {load_start} at the start, {load_average()} at the end; "
        f"{wall_s / 60:.1f} min.",
        "",
        f"Workload: recall, 8 documents per request, {requests} measured requests, repair query@15; "
        f"a greedy continuation of {args.tokens} tokens. Per dtype, the engine that wrote the entries "
        "(answering from its in-memory float32 store) against a restarted engine that loaded every "
        "segment from the disk tier. float32 on disk is the control.",
        "",
        f"| stored as | bytes per token on disk | segment tokens loaded | KL mean | KL max "
        f"| KL ≤ {KL_CLOSE:g} | top-1 | same {args.tokens} tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.dtype} | {r.bytes_per_token:,.0f} | {r.loaded_tokens:,} | {sum(r.kls) / len(r.kls):.2e} "
            f"| {max(r.kls):.2e} | {100 * (close_rate(r.kls) or 0):.0f}% | {100 * r.top1:.0f}% "
            f"| {100 * r.same:.0f}% |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
