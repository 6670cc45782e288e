"""The quality-vs-FLOPs frontier of the repair policies across bench runs, one column per model.

    python bench/analyses/frontier.py DIR [DIR ...] --out bench/results/fidelity_frontier.png

Each DIR holds a run's results.json. The runs of one model must have measured the same requests (the
same workload and sizes), or their points would not compare; a system in several runs of a model is
drawn from the first run that has it. Rows: mean next-token KL against the full prefill (log scale),
the share of requests within KL 0.05, and first-token agreement, each against the mean prefill FLOPs
as a share of the full prefill's. A policy's points (budgets, or the adaptive policy's targets) are
joined by a line. The markdown table of the same points goes to stdout.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from kvsplice.bench.metrics import KL_CLOSE, SystemSummary
from kvsplice.bench.plots import KL_EXACT, _colour, _family, _short
from kvsplice.bench.report import _kl, _pct
from kvsplice.bench.results import BenchResult
from kvsplice.bench.summary import refresh
from kvsplice.bench.systems import name_parts


@dataclass(frozen=True)
class Point:
    model: str
    system: str
    summary: SystemSummary
    run: Path


def collect(runs: list[tuple[Path, BenchResult]]) -> dict[str, list[Point]]:
    """Per model (in the order met), its splice systems' points; ValueError if two runs of one model
    measured different requests."""
    by_model: dict[str, list[Point]] = {}
    specs: dict[str, tuple[str, dict[str, object], Path]] = {}
    for path, result in runs:
        model = result.model.name if result.model else "unknown model"
        spec = dict(result.spec)
        first = specs.setdefault(model, (result.workload, spec, path))
        if (first[0], first[1]) != (result.workload, spec):
            raise ValueError(
                f"{path} measured other requests than {first[2]} ({result.workload} {spec} against "
                f"{first[0]} {first[1]}): their points would not compare"
            )
        points = by_model.setdefault(model, [])
        known = {p.system for p in points}
        for s in result.summaries:
            if s.system.startswith("splice:") and s.system not in known and s.flops_frac is not None:
                points.append(Point(model, s.system, s, path))
    return by_model


def _budget(system: str) -> float:
    label = name_parts(system)[1]
    return float(label) if label else 0.0


def _percent(rate: float | None) -> float | None:
    return None if rate is None else 100 * rate


def plot(by_model: dict[str, list[Point]], path: Path) -> None:
    rows = (
        ("mean KL(full ‖ system), nats", lambda s: s.kl_mean),
        (f"requests within KL {KL_CLOSE:g} (%)", lambda s: _percent(s.close_rate)),
        ("first token = full prefill's (%)", lambda s: _percent(s.top1_rate)),
    )
    fig, axes = plt.subplots(len(rows), len(by_model), figsize=(6.2 * len(by_model), 11), squeeze=False)
    for col, (model, points) in enumerate(by_model.items()):
        families: dict[str, list[Point]] = {}
        for p in points:
            families.setdefault(_family(p.system), []).append(p)
        colours: dict[str, str] = {}
        for family, members in families.items():
            members.sort(key=lambda p: p.summary.flops_frac or 0.0)
            xs = [100 * (p.summary.flops_frac or 0.0) for p in members]
            colour = _colour(family, colours)
            for row, (_, value) in enumerate(rows):
                ax = axes[row][col]
                shown = [
                    (p, x, max(y, KL_EXACT) if row == 0 else y)
                    for p, x in zip(members, xs, strict=True)
                    if (y := value(p.summary)) is not None
                ]
                ax.plot([x for _, x, _ in shown], [y for _, _, y in shown], "o-", color=colour, label=family)
                for p, x, y in shown:
                    # A system named without "@" is the adaptive policy at the engine's default target.
                    label = name_parts(p.system)[1] or "default"
                    ax.annotate(label, (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
        n = points[0].summary.requests if points else 0
        for row, (label, _value) in enumerate(rows):
            ax = axes[row][col]
            ax.set_xlim(0, max(30.0, *(100 * (p.summary.flops_frac or 0.0) + 5 for p in points)))
            ax.set_xlabel("prefill FLOPs, % of a full prefill's")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
        axes[0][col].set_yscale("log")
        axes[0][col].set_title(f"{model} ({n} requests)")
        axes[1][col].axhline(95, color="gray", lw=0.8, ls="--")
        axes[2][col].axhline(98, color="gray", lw=0.8, ls="--")
        axes[0][col].legend(fontsize=7)
    fig.suptitle(
        "Repair policies: fidelity against prefill FLOPs (labels: budget %, or adaptive's target KL)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _run_names(by_model: dict[str, list[Point]]) -> dict[Path, str]:
    """Each run as its path below the directory all runs share (a bare leaf such as `layer8` of
    `recall_smollm2_8docs_probe/layer8` would not say which run it is)."""
    runs = {p.run.resolve(): p.run for points in by_model.values() for p in points}
    if not runs:
        return {}
    common = Path(os.path.commonpath(list(runs)))
    names = {}
    for resolved, run in runs.items():
        below = resolved.relative_to(common).as_posix()
        names[run] = run.name if below == "." else below
    return names


def table(by_model: dict[str, list[Point]]) -> str:
    names = _run_names(by_model)
    out = []
    for model, points in by_model.items():
        out += [
            f"**{model}**",
            "",
            f"| system | FLOPs | KL | KL ≤ {KL_CLOSE:g} | top-1 | accuracy | run |",
            "|---|---:|---:|---:|---:|---:|---|",
        ]
        for p in sorted(points, key=lambda p: (_family(p.system), _budget(p.system))):
            s = p.summary
            out.append(
                f"| {_short(p.system)} | {_pct(s.flops_frac, 1)} | {_kl(s.kl_mean)} | {_pct(s.close_rate)} "
                f"| {_pct(s.top1_rate)} | {_pct(s.accuracy)} | {names[p.run]} |"
            )
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python bench/analyses/frontier.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("runs", nargs="+", type=Path, help="run directories, each with a results.json")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    runs = [(d, BenchResult.from_json((d / "results.json").read_text())) for d in args.runs]
    for _, result in runs:
        # Runs recorded before a measure existed (the share within KL_CLOSE) gain it from their records.
        refresh(result)
    by_model = collect(runs)
    plot(by_model, args.out)
    print(table(by_model))


if __name__ == "__main__":
    main()
