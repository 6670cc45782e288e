"""Full-prefill time of kvsplice's runner against transformers' own model on the same weights.

Both run in this process with the same torch threads, alternating rep by rep, so machine noise hits
both alike. transformers is timed twice: as called by default (logits for every position) and with
logits_to_keep=1 (only the last position, what a server needs), which is the fair comparison.
Prints the ratios and the achieved GFLOP/s beside a float32 matmul peak measured in the same run.

    python bench/prefill_vs_transformers.py [--lengths 512 1024 2048 4096] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

import torch
import transformers

from kvsplice.bench.results import cpu_name, load_average, timed
from kvsplice.kv.pool import KVPool
from kvsplice.loader.gguf import convert_gguf, default_model_path
from kvsplice.models.build import load_model
from kvsplice.models.runner import ModelRunner


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    """GFLOP/s of a float32 n x n matmul, best of reps."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    best = float("inf")
    for _ in range(reps):
        best = min(best, timed(lambda: torch.mm(a, b)))
    return 2 * n**3 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefill_vs_transformers.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = convert_gguf(default_model_path())
    ours = load_model(model_dir, torch.float32, torch.device("cpu"))
    pool = KVPool(ours.cfg, 2**30, 16, torch.float32, torch.device("cpu"))
    runner = ModelRunner(ours, pool)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)

    rows = []
    for length in args.lengths:
        ids = torch.randint(3, ours.cfg.vocab_size, (length,), generator=gen)
        ids[0] = 2  # BOS
        table = pool.allocator.allocate(-(-length // 16))
        positions = list(range(length))

        def run_ours(ids=ids, table=table, positions=positions) -> None:
            runner.prefill(table, ids.tolist(), positions)

        def run_hf(keep: int, ids=ids) -> None:
            with torch.inference_mode():
                hf(ids[None], logits_to_keep=keep, use_cache=False)

        times: dict[str, list[float]] = {"kvsplice": [], "hf_keep1": [], "hf_all": []}
        run_ours()  # warm-up of both, untimed
        run_hf(1)
        for _ in range(args.reps):
            times["kvsplice"].append(timed(run_ours))
            times["hf_keep1"].append(timed(lambda: run_hf(1)))
            times["hf_all"].append(timed(lambda: run_hf(0)))
        pool.allocator.decref(table)
        table = pool.allocator.allocate(-(-length // 16))
        flops = runner.prefill(table, ids.tolist(), positions).flops
        pool.allocator.decref(table)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((length, med, flops))
        print(
            f"{length:5d} tokens: kvsplice {med['kvsplice']:.2f} s, transformers (last logits) "
            f"{med['hf_keep1']:.2f} s ({med['hf_keep1'] / med['kvsplice']:.2f}x), "
            f"transformers (all logits) {med['hf_all']:.2f} s ({med['hf_all'] / med['kvsplice']:.2f}x)",
            flush=True,
        )
    peak = matmul_peak()
    lines = [
        "# Full prefill: kvsplice runner vs transformers, same weights, same threads",
        "",
        f"Model: Gemma 3 270M (default GGUF, float32). torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {args.threads} threads, {platform.processor() or platform.machine()}, "
        f"{cpu_name()}. Median of {args.reps} alternating reps. Float32 matmul peak (2048^3) measured "
        f"in the same run: {peak:.0f} GFLOP/s.",
        "",
        "| tokens | kvsplice s | transformers s (logits_to_keep=1) | speedup "
        "| transformers s (all logits) | speedup | kvsplice GFLOP/s | % of matmul peak |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for length, med, flops in rows:
        ours, keep1, full = med["kvsplice"], med["hf_keep1"], med["hf_all"]
        gflops = flops / ours / 1e9
        lines.append(
            f"| {length} | {ours:.2f} | {keep1:.2f} | {keep1 / ours:.2f}x | {full:.2f} | {full / ours:.2f}x "
            f"| {gflops:.0f} | {100 * gflops / peak:.0f}% |"
        )
    lines += [
        "",
        "FLOPs are kvsplice's estimate for the work it does (projections, MLP, attention over visible keys",
        "only, the last position's LM head); transformers does more for the same result (its sliding-window",
        "layers attend over masked keys too, and by default it computes the LM head at every position).",
        f"Load average while running: {load_average()}.",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
