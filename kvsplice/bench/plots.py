"""PNG plots of a bench run (matplotlib, Agg backend): the fidelity-TTFT frontier, reuse per system,
for chat/agent TTFT and computed tokens per turn, and for recall accuracy by answer position."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter, ScalarFormatter

from kvsplice.bench.metrics import ALL, SystemSummary, by_group, settings
from kvsplice.bench.results import BenchResult
from kvsplice.bench.systems import name_parts

# KL below this is float rounding (the exact systems measure ~1e-12): drawn on the axis floor.
KL_EXACT = 1e-6
_COLOURS = {
    "off": "black",
    "hash": "tab:gray",
    "radix": "tab:brown",
    "none": "tab:red",
    "boundary": "tab:orange",
    "deviation": "tab:blue",
    "recency": "tab:purple",
    "query": "tab:cyan",
    "attention": "tab:pink",
    "adaptive": "tab:olive",
    "full": "tab:green",
}
_OTHER_COLOURS = ["gold", "lime", "navy"]


def _family(system: str) -> str:
    """A policy's line: its systems at each budget, with the same suffixes (a shift, unmarked prompts)."""
    policy, _, rest = name_parts(system)
    return policy + rest


def _short(system: str) -> str:
    return system.removeprefix("splice:")


def _colour(family: str, seen: dict[str, str]) -> str:
    if family not in seen:
        seen[family] = _COLOURS.get(family) or _OTHER_COLOURS[len(seen) % len(_OTHER_COLOURS)]
    return seen[family]


def _label(
    ax: plt.Axes, placed: list[tuple[float, float]], text: str, x: float, y: float, log_y: bool
) -> None:
    """Annotate a point; labels of points that (nearly) coincide are stacked instead of overprinted."""

    def close(px: float, py: float) -> bool:
        same_y = 0.7 <= py / y <= 1.4 if log_y else abs(py - y) <= 0.04 * (ax.get_ylim()[1] or 1)
        return abs(px - x) <= 0.08 * max(px, x) and same_y

    near = sum(close(px, py) for px, py in placed)
    placed.append((x, y))
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 3 + 8 * near), fontsize=7)


def frontier(result: BenchResult, path: Path) -> None:
    """Left: mean KL against TTFT p50; right: mean leading tokens of the continuation equal to the
    full prefill's. Each policy's budgets are joined by a line and labelled by budget."""
    done = [s for s in result.summaries if s.ttft_p50_s is not None and s.kl_mean is not None]
    fig, (ax_kl, ax_match) = plt.subplots(1, 2, figsize=(12.5, 5))
    inexact = [s.kl_mean for s in done if s.kl_mean is not None and s.kl_mean >= KL_EXACT]
    floor = 10 ** (math.floor(math.log10(min(inexact))) - 1) if inexact else KL_EXACT
    n = result.continuation_tokens
    ax_match.set_ylim(-0.05 * n, 1.12 * n)
    placed: dict[str, list[tuple[float, float]]] = {"kl": [], "match": []}
    families: dict[str, list[SystemSummary]] = {}
    for s in done:
        families.setdefault(_family(s.system), []).append(s)
    colours: dict[str, str] = {}
    for family, members in families.items():
        members.sort(key=lambda s: s.ttft_p50_s or 0.0)
        xs = [(s.ttft_p50_s or 0.0) * 1000 for s in members]
        kls = [max(s.kl_mean or 0.0, floor) if (s.kl_mean or 0.0) >= KL_EXACT else floor for s in members]
        match = [s.matched_mean or 0.0 for s in members]
        colour = _colour(family, colours)
        # Policies swept over budgets are labelled by budget (the legend names the policy).
        texts = [_short(s.system) if len(members) == 1 else name_parts(s.system)[1] for s in members]
        for key, ax, ys in (("kl", ax_kl, kls), ("match", ax_match, match)):
            ax.plot(xs, ys, "o-" if len(members) > 1 else "o", color=colour, label=family)
            for x, y, text in zip(xs, ys, texts, strict=True):
                _label(ax, placed[key], text, x, y, log_y=key == "kl")
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel(f"mean KL(full ‖ system), nats (exact, < {KL_EXACT:g}: drawn at {floor:g})")
    ax_match.set_ylabel(f"leading tokens equal to the full prefill's (mean, of {n})")
    for ax in (ax_kl, ax_match):
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("TTFT p50 (ms, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    if done:
        ax_kl.legend(fontsize=8, loc="center right")
    else:
        ax_kl.text(0.5, 0.5, "no request compared with the reference", ha="center", transform=ax_kl.transAxes)
    fig.suptitle(f"{result.workload}: fidelity against time to first token (numbers: repair budget, %)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reuse(result: BenchResult, path: Path) -> None:
    rows = [s for s in result.summaries if s.computed_frac is not None]
    names = [_short(s.system) for s in rows]
    prefix = [(s.prefix_hit_frac or 0) * 100 for s in rows]
    recomputed = [(s.recomputed_frac or 0) * 100 for s in rows]
    spliced = [((s.segment_hit_frac or 0) + (s.discovered_hit_frac or 0)) * 100 for s in rows]
    moved = [h - r for h, r in zip(spliced, recomputed, strict=True)]
    computed = [100 - p - m - r for p, m, r in zip(prefix, moved, recomputed, strict=True)]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 2.2))
    left = [0.0] * len(rows)
    for values, label, colour in (
        (prefix, "prefix hit (exact)", "tab:brown"),
        (moved, "segment hit, moved as is", "tab:blue"),
        (recomputed, "segment hit, recomputed by repair", "tab:orange"),
        (computed, "computed", "lightgray"),
    ):
        ax.barh(names, values, left=left, label=label, color=colour)
        left = [a + b for a, b in zip(left, values, strict=True)]
    ax.invert_yaxis()
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of prompt tokens (%)")
    ax.set_title(f"{result.workload}: where the prompt's KV came from (measured requests)")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.4 / max(len(rows), 1)), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def turns(result: BenchResult, path: Path) -> None:
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(12, 4.4))
    for name in result.systems:
        rows = sorted(
            (t for t in result.turns if t.system == name and t.ttft_p50_s is not None), key=lambda t: t.turn
        )
        if not rows:
            continue
        colour = _COLOURS.get(_family(name))
        xs = [t.turn for t in rows]
        ax_t.plot(xs, [(t.ttft_p50_s or 0) * 1000 for t in rows], "o-", label=_short(name), color=colour)
        ax_c.plot(xs, [t.computed_mean or 0 for t in rows], "o-", label=_short(name), color=colour)
    ax_t.set_ylabel("TTFT p50 (ms)")
    ax_c.set_ylabel("prompt tokens computed (mean)")
    for ax in (ax_t, ax_c):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("turn")
        ax.grid(True, alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"{result.workload}: per turn")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def positions(result: BenchResult, path: Path) -> None:
    """Per setting, accuracy with its 95% Wilson interval at each answer position, a line per system."""
    rows = [r for r in by_group(result.records, result.systems) if r.setting != ALL]
    settings = list(dict.fromkeys(r.setting for r in rows))
    fig, axes = plt.subplots(1, len(settings), figsize=(3.6 * len(settings) + 1.5, 4.2), squeeze=False)
    colours: dict[str, str] = {}
    width = 0.3 / max(len(result.systems) - 1, 1)
    for ax, setting in zip(axes[0], settings, strict=True):
        cells = [r for r in rows if r.setting == setting and r.answer_position != ALL]
        places = list(dict.fromkeys(r.answer_position for r in cells))
        for i, name in enumerate(result.systems):
            # Systems side by side at each position, so that their intervals do not hide each other.
            shift = (i - (len(result.systems) - 1) / 2) * width
            points = [
                (places.index(r.answer_position) + shift, r.accuracy)
                for r in cells
                if r.system == name and r.accuracy is not None
            ]
            ax.errorbar(
                [x for x, _ in points],
                [a.estimate * 100 for _, a in points],
                yerr=[
                    [(a.estimate - a.low) * 100 for _, a in points],
                    [(a.high - a.estimate) * 100 for _, a in points],
                ],
                fmt="o-",
                capsize=3,
                color=_colour(_family(name), colours),
                label=_short(name),
            )
        ax.set_xticks(range(len(places)), places)
        ax.set_ylim(-3, 103)
        ax.set_title(setting)
        ax.set_xlabel("answer document's position")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%), 95% Wilson interval")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"{result.workload}: accuracy by setting and answer position")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(result: BenchResult, out: Path) -> list[str]:
    """Write the plots into `out`; returns their file names."""
    names = ["frontier.png", "reuse.png"]
    frontier(result, out / names[0])
    reuse(result, out / names[1])
    if result.turns:
        names.append("turns.png")
        turns(result, out / names[-1])
    if settings(result.records):
        names.append("positions.png")
        positions(result, out / names[-1])
    return names
