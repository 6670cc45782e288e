"""Across runs: re-render each run's results, report and plots from its results.json (no model runs),
draw reuse per workload, and print one compact table over the workloads.

    python -m kvsplice.bench.summary bench/results        # every */results.json below it
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvsplice.bench.metrics import SystemSummary, common_prefix, per_turn, summarize
from kvsplice.bench.plots import write_plots
from kvsplice.bench.report import _ms, _pct, _times, markdown
from kvsplice.bench.results import BenchResult

# The systems the cross-workload view shows, when a run has them.
HEADLINE = (
    "hash",
    "radix",
    "splice:none@0",
    "splice:deviation@15",
    "splice:recency@15",
    "splice:full@100",
)


def load(root: Path) -> list[tuple[Path, BenchResult]]:
    """(run directory, result) for every */results.json under root."""
    return [(p.parent, BenchResult.from_json(p.read_text())) for p in sorted(root.glob("*/results.json"))]


def refresh(result: BenchResult) -> None:
    """Recompute what derives from the records alone (continuation match, summaries, per-turn rows),
    so that results written by an earlier version gain the current measures. KL and top-1 need the
    logits, which are not kept: they stay as recorded."""
    reference = {r.request_id: r for r in result.records if r.system == result.systems[0] and r.ok}
    for record in result.records:
        ref = reference.get(record.request_id)
        if record.ok and not record.warmup and ref is not None:
            record.matched_tokens = common_prefix(record.token_ids, ref.token_ids)
    result.summaries = summarize(result.records, result.systems)
    result.turns = per_turn(result.records, result.systems) if result.turns else []


def rerender(result: BenchResult, out: Path) -> None:
    """results.json, report.md and the plots again, from the recorded results (no model runs)."""
    refresh(result)
    result.write_json(out / "results.json")
    names = write_plots(result, out)
    (out / "report.md").write_text(markdown(result, names))


def _headline(result: BenchResult) -> list[SystemSummary]:
    by = {s.system: s for s in result.summaries}
    return [by[name] for name in HEADLINE if name in by]


def reuse_by_workload(results: list[BenchResult], labels: list[str], path: Path) -> None:
    """Grouped bars: per run (labelled by its directory), the share of prompt tokens each headline
    system reused, split into prefix hits and spliced segments."""
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(HEADLINE)
    colours = ("tab:gray", "tab:brown", "tab:red", "tab:blue", "tab:purple", "tab:green")
    for i, (name, colour) in enumerate(zip(HEADLINE, colours, strict=True)):
        xs, prefix, segment = [], [], []
        for w, result in enumerate(results):
            s = next((s for s in result.summaries if s.system == name), None)
            if s is None or s.prefix_hit_frac is None:
                continue
            xs.append(w + (i - (len(HEADLINE) - 1) / 2) * width)
            prefix.append((s.prefix_hit_frac or 0) * 100)
            segment.append((s.segment_hit_frac or 0) * 100)
        ax.bar(xs, prefix, width, color=colour, label=name)
        ax.bar(xs, segment, width, bottom=prefix, color=colour, alpha=0.45, hatch="//")
    ax.set_xticks(range(len(results)), labels)
    ax.set_ylabel("prompt tokens reused (%): solid prefix hit, hatched segment")
    ax.set_ylim(0, 105)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=len(HEADLINE), loc="upper center", bbox_to_anchor=(0.5, -0.08))
    ax.set_title("Reuse per workload (measured requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: list[BenchResult]) -> str:
    rows = [
        "| workload | system | TTFT p50 ms | speedup | reused (prefix + segment) | computed | KL | same N "
        "| match | accuracy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        ref = result.summaries[0]
        for s in [ref, *_headline(result)]:
            reused = None if s.prefix_hit_frac is None else s.prefix_hit_frac + (s.segment_hit_frac or 0)
            kl = "–" if s.kl_mean is None else f"{s.kl_mean:.3f}"
            rows.append(
                f"| {result.workload} | {s.system} | {_ms(s.ttft_p50_s)} | {_times(s.speedup_p50)} | "
                f"{_pct(reused)} ({_pct(s.prefix_hit_frac)} + {_pct(s.segment_hit_frac)}) | "
                f"{_pct(s.computed_frac)} | {kl} | {_pct(s.same_rate)} | "
                f"{'–' if s.matched_mean is None else f'{s.matched_mean:.1f}'} | {_pct(s.accuracy)} |"
            )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--no-rerender", action="store_true", help="keep each run's report and plots")
    args = parser.parse_args(argv)
    runs = load(args.root)
    if not runs:
        raise SystemExit(f"no */results.json under {args.root}")
    order = ["rag", "qa", "fewshot", "agent", "chat"]
    runs.sort(key=lambda run: order.index(run[1].workload) if run[1].workload in order else len(order))
    if not args.no_rerender:
        for directory, result in runs:
            rerender(result, directory)
    results = [result for _, result in runs]
    reuse_by_workload(results, [directory.name for directory, _ in runs], args.root / "reuse_by_workload.png")
    print(table(results))


if __name__ == "__main__":
    main()
