"""The floor under issue 10's latency targets: what the 8 streams' decode work costs inside a prefill step.

bench/serve_latency.py measures the scheduler as built: each step runs the running streams' decode
batch and the prefill chunk as separate runner calls. A scheduler that fused the decode rows into the
chunk's forward pass (vLLM's mixed batch) would share the transformer weights' reads and the per-layer
overhead between them; this measures, on the runner itself, the least any step with a C-token chunk
and 8 decode rows can cost, whatever the scheduler:

- D, the idle decode step: `ModelRunner.decode` of 8 sequences (their context ~`--stream-context`);
- T(C), a C-token chunk of the long prompt `--at` tokens in, without logits (a middle chunk);
- the 8 rows' least extra cost in a fused pass, D' = M + H(8): M is the time a chunk of 64 + 8 tokens
  takes over one of 64 (8 more query rows through every layer, at a short context like a stream's;
  the median of paired differences), and H(8) the LM head for 8 rows, which only the decode rows need.

With steps of T(C) + D' while the long prompt prefills, its inter-token latency is (T(C) + D') / D of
the idle one and its prefill takes (T(C) + D') / T(C) of an unchunked one (whose single step holds no
decode). The targets need both <= 3 and <= 1.1 at one C, so D' <= 3 D / 11. The bound holds for any
schedule, not only one decode batch per chunk: a prefill of time P during which every stream gets a
token at least every 3 D holds at least P / (3 D) decode rounds of at least D' each, so it takes at
least 1 / (1 - D' / (3 D)) of an unchunked prefill. Timings interleave every measurement per
repetition and report medians (the machine is noisy; the ratios are what count), with the torch thread
count the server uses by default (1 on this machine).
Run: python bench/step_floor.py   (~3 minutes; writes bench/results/step_floor.md)
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from kvsplice import LLM
from kvsplice.bench.results import cpu_name, load_average, timed
from kvsplice.models.runner import DecodeItem, ForwardChunk, ModelRunner

RESULT = Path(__file__).parent / "results" / "step_floor.md"
STREAMS = 8
ITL_TARGET = 3.0
ROWS_CHUNK = 64
PAIRS_PER_REP = 5
PREFILL_TARGET = 1.1


def measure(
    runner: ModelRunner, chunks: list[int], at: int, stream_context: int, reps: int
) -> dict[str, float]:
    """Median seconds of every measurement, interleaved per repetition."""
    bs = runner.pool.block_size
    span = at + max(chunks) + STREAMS + bs
    long_table = list(range(-(-span // bs)))
    stream_blocks = -(-(stream_context + 1) // bs)
    tables = [
        list(range(len(long_table) + i * stream_blocks, len(long_table) + (i + 1) * stream_blocks))
        for i in range(STREAMS)
    ]
    assert len(long_table) + STREAMS * stream_blocks <= runner.pool.num_blocks, "raise --kv-cache-gb"
    items = [DecodeItem(t, 1000 + i, stream_context) for i, t in enumerate(tables)]
    hidden = torch.randn(STREAMS, runner.cfg.hidden_size)

    def chunk(start: int, n: int) -> Callable[[], object]:
        positions = list(range(start, start + n))
        ids = [1000 + p % 5000 for p in positions]
        return lambda: runner.forward(ForwardChunk(long_table, positions, ids, range(runner.num_layers)))

    def head(rows: int) -> Callable[[], object]:
        @torch.inference_mode()
        def run() -> object:
            return runner.model.logits(hidden[:rows])

        return run

    cases: dict[str, Callable[[], object]] = {"D": lambda: runner.decode(items), "H1": head(1)}
    cases[f"H{STREAMS}"] = head(STREAMS)
    for c in chunks:
        cases[f"T{c}"] = chunk(at, c)
    # The extra rows' cost is a small difference of two timings: taken as the median of paired
    # differences (a chunk of ROWS_CHUNK tokens at a stream's context, then one of 8 more), repeated.
    small, large = chunk(stream_context, ROWS_CHUNK), chunk(stream_context, ROWS_CHUNK + STREAMS)
    for fn in [*cases.values(), small, large]:
        fn()
    samples: dict[str, list[float]] = {name: [] for name in [*cases, "M"]}
    for _ in range(reps):
        for name, fn in cases.items():
            samples[name].append(timed(fn))
        for _ in range(PAIRS_PER_REP):
            samples["M"].append(timed(large) - timed(small))
    return {name: statistics.median(s) for name, s in samples.items()}


def render(args: argparse.Namespace, med: dict[str, float], threads: int, load: object) -> str:
    ms = 1000.0
    d, h8 = med["D"], med[f"H{STREAMS}"]
    extra = max(0.0, med["M"])
    fused = extra + h8
    lines = [
        "# The floor under the latency targets: decode rows inside a prefill step",
        "",
        f"Command: `python bench/step_floor.py --chunks {' '.join(map(str, args.chunks))} --at {args.at} "
        f"--stream-context {args.stream_context} --reps {args.reps}`",
        f"Machine: {cpu_name()}, {torch.get_num_threads()} torch thread(s) of {threads} CPUs; Python "
        f"{platform.python_version()}, torch {torch.__version__}; default model; load average after: {load}.",
        "",
        f"- idle decode step of {STREAMS} streams, D: {d * ms:.0f} ms",
        f"- LM head, H({STREAMS}): {h8 * ms:.0f} ms for {STREAMS} rows ({h8 / d:.2f} D); H(1): "
        f"{med['H1'] * ms:.0f} ms for one",
        f"- {STREAMS} more query rows in a {ROWS_CHUNK}-token chunk at a stream's context, M: "
        f"{med['M'] * ms:.0f} ms (median of {args.reps * PAIRS_PER_REP} paired differences)",
        f"- so a fused step's decode share D' = M + H({STREAMS}) >= {fused * ms:.0f} ms = {fused / d:.2f} D "
        f"(with a head that read its matrix once for all rows in the time of one row: "
        f"{(extra + med['H1']) / d:.2f} D)",
        "",
        f"| chunk C | T(C) at {args.at} | step T(C) + D' | ITL during prefill / idle | prefill / unchunked "
        "| both targets |",
        "|---:|---:|---:|---:|---:|---|",
    ]
    for c in args.chunks:
        t = med[f"T{c}"]
        itl, prefill = (t + fused) / d, (t + fused) / t
        ok = itl <= ITL_TARGET and prefill <= PREFILL_TARGET
        lines.append(
            f"| {c} | {t * ms:.0f} ms | {(t + fused) * ms:.0f} ms | {itl:.2f}x | {prefill:.2f}x "
            f"| {'yes' if ok else 'no'} |"
        )
    lines += [
        "",
        f"Targets: ITL <= {ITL_TARGET:g}x idle and prefill <= {PREFILL_TARGET:g}x unchunked at the same C. "
        "The second needs D' <= 0.1 T(C), and then the first T(C) + D' >= 11 D' <= 3 D: both hold at "
        "some C only if D' <= 3 D / 11 = 0.27 D, at a C with 10 D' <= T(C) <= 3 D - D'. M is "
        "floored at 0 where noise makes it negative.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--at", type=int, default=8192, help="where in the long prompt the chunk lies")
    parser.add_argument("--stream-context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads (the server default here)")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    llm = LLM(kv_cache_gb=args.kv_cache_gb, num_threads=args.num_threads)
    med = measure(llm.engine.runner, args.chunks, args.at, args.stream_context, args.reps)
    text = render(args, med, len(os.sched_getaffinity(0)), load_average())
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
