"""What storing segments' KV in a smaller dtype on the disk tier costs in output fidelity (issue 13).

Per stored dtype (float32, float16, bfloat16): an engine with a disk tier in that dtype runs the
recall workload's warm-up requests (their segments are written through to disk) and is closed; per
repair policy, a fresh engine on the same directory (a restart: its pool is empty, so every segment
is loaded from disk) runs the measured requests. Each dtype's restarted engine is compared with the
float32 one under the same repair: the same requests, from the same empty state, so the only
difference is the stored dtype (KL, top-1 agreement, the greedy continuation; and the entry bytes
per token on disk); the float32 rows are the references themselves. Without repair (`none`) that is
the stored KV's own error; a policy that ranks tokens by the KV may also pick other tokens from
slightly different KV, which can move the answer more than the rounding itself.

The float32 restart is also compared with the writer engine before it closed, which answered the
same requests from its pool: that difference is not the disk's but the state's (the writer's prefix
cache holds the warm-up prompts, so a measured request that starts like one takes an exact prefix
where the restarted engine splices, and repairs a different set of tokens).

Run: python bench/store_fidelity.py   (writes bench/results/store_fidelity.md; ~15 minutes)
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
from kvsplice.outputs import RequestOutput
from kvsplice.sampling import SamplingParams, kl_divergence

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Row:
    repair: str
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
    parser.add_argument(
        "--repairs",
        nargs="+",
        default=["none", "attention"],
        help="repair policies at 15%%: none shows the stored KV's own error; a policy that ranks tokens "
        "may also choose other tokens from slightly different KV",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results/store_fidelity.md"))
    args = parser.parse_args(argv)
    load_start, t0 = load_average(), time.perf_counter()
    workload = make_workload("recall", WorkloadSpec(requests=args.requests, doc_counts=(8,)))
    system = System("splice:attention@15", "radix", policy="attention", budget_pct=15)  # marks the documents
    warm = [prompt_parts(system, r) for r in workload.requests if r.warmup]
    measured = [prompt_parts(system, r) for r in workload.measured]
    docs = {d.text for r in workload.requests if r.warmup for d in r.docs}
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, return_first_logits=True)
    rows = []
    # (repair, dtype) -> the outputs of an engine restarted on that dtype's directory.
    restarted: dict[tuple[str, str], list[RequestOutput]] = {}
    with tempfile.TemporaryDirectory() as root:
        for dtype in DTYPES:
            directory = Path(root) / dtype
            writer = _engine(args, directory, dtype)
            tokenizer = writer.tokenizer
            assert tokenizer is not None, "the store bench needs the model's tokenizer"
            segment_tokens = sum(len(tokenizer.encode(d)) for d in docs)
            writer.generate(warm, params, _options(args.repairs[-1]))
            if dtype == "float32":
                in_memory = writer.generate(measured, params, _options(args.repairs[-1]))
            writer.close()  # waits for the write-through of every segment
            del writer
            gc.collect()
            stored = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
            for repair in args.repairs:
                # A fresh engine per repair: each starts empty and loads every segment from disk.
                reader = _engine(args, directory, None)
                restarted[repair, dtype] = reader.generate(measured, params, _options(repair))
                reader.close()
                del reader
                gc.collect()
                reference = restarted[repair, "float32"]
                rows.append(_row(repair, dtype, stored / segment_tokens, reference, restarted[repair, dtype]))
                print(f"{repair} {dtype}: KL mean {sum(rows[-1].kls) / len(rows[-1].kls):.3g}", flush=True)
    last = args.repairs[-1]
    restart = _row(last, "float32", 0.0, in_memory, restarted[last, "float32"])
    _write(args, rows, restart, len(measured), load_start, time.perf_counter() - t0)


def _options(repair: str) -> RequestOptions:
    return RequestOptions(repair=repair, recompute_ratio=0.15)


def _row(
    repair: str, dtype: str, bytes_per_token: float, ref: list[RequestOutput], out: list[RequestOutput]
) -> Row:
    """`out` against `ref`, request by request."""
    pairs = list(zip(ref, out, strict=True))
    assert all(r.first_logits is not None and o.first_logits is not None for r, o in pairs)
    return Row(
        repair,
        dtype,
        bytes_per_token,
        sum(o.metrics.store_hit_tokens.get("disk", 0) for o in out),
        [kl_divergence(r.first_logits, o.first_logits) for r, o in pairs],  # type: ignore[arg-type]
        _share(top1_agree(r.first_logits, o.first_logits) for r, o in pairs),  # type: ignore[arg-type]
        _share(r.token_ids == o.token_ids for r, o in pairs),
    )


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
    args: argparse.Namespace, rows: list[Row], restart: Row, requests: int, load_start: object, wall_s: float
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
        f"Workload: recall, 8 documents per request, {requests} measured requests, repair at 15%; "
        f"a greedy continuation of {args.tokens} tokens. Per dtype, an engine restarted on the disk tier "
        "that dtype's writer filled (every segment loaded from disk) against the float32 one, on the "
        "same requests from the same empty state: the difference is the stored dtype alone.",
        "",
        f"| repair | stored as | bytes per token on disk | segment tokens loaded | KL mean | KL max "
        f"| KL ≤ {KL_CLOSE:g} | top-1 | same {args.tokens} tokens |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.repair} | {r.dtype} | {r.bytes_per_token:,.0f} | {r.loaded_tokens:,} "
            f"| {sum(r.kls) / len(r.kls):.2e} | {max(r.kls):.2e} | {100 * (close_rate(r.kls) or 0):.0f}% "
            f"| {100 * r.top1:.0f}% "
            f"| {100 * r.same:.0f}% |"
        )
    lines += [
        "",
        f"What a restart changes (not the disk: the state). The float32 restart ({restart.repair}) against "
        "the writer, which "
        "answered the same requests from its pool with the warm-up prompts in its prefix cache: "
        f"KL mean {sum(restart.kls) / len(restart.kls):.2e}, max {max(restart.kls):.2e}, top-1 "
        f"{100 * restart.top1:.0f}%, same {args.tokens} tokens {100 * restart.same:.0f}%.",
    ]
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
