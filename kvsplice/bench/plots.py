"""PNG plots of a bench run (matplotlib, Agg backend): the fidelity-TTFT frontier, reuse per system,
and for chat/agent TTFT and computed tokens per turn."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator

from kvsplice.bench.metrics import SystemSummary
from kvsplice.bench.results import BenchResult

# KL is drawn on a log axis; exact systems (KL 0) sit on this floor.
KL_FLOOR = 1e-7
_COLOURS = {
    "off": "black",
    "hash": "tab:gray",
    "radix": "tab:brown",
    "none": "tab:red",
    "boundary": "tab:orange",
    "deviation": "tab:blue",
    "full": "tab:green",
}


def _family(system: str) -> str:
    return system.removeprefix("splice:").partition("@")[0]


def _short(system: str) -> str:
    return system.removeprefix("splice:")


def _label(
    ax: plt.Axes, placed: list[tuple[float, float]], text: str, x: float, y: float, log_y: bool
) -> None:
    """Annotate a point; labels of points that (nearly) coincide are stacked instead of overprinted."""

    def close(px: float, py: float) -> bool:
        same_y = 0.5 <= py / y <= 2 if log_y else abs(py - y) <= 5
        return abs(px - x) <= 0.12 * max(px, x) and same_y

    near = sum(close(px, py) for px, py in placed)
    placed.append((x, y))
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4 + 9 * near), fontsize=7)


def frontier(result: BenchResult, path: Path) -> None:
    done = [s for s in result.summaries if s.ttft_p50_s is not None and s.kl_mean is not None]
    fig, (ax_kl, ax_same) = plt.subplots(1, 2, figsize=(12, 4.8))
    placed: dict[str, list[tuple[float, float]]] = {"kl": [], "same": []}
    families: dict[str, list[SystemSummary]] = {}
    for s in done:
        families.setdefault(_family(s.system), []).append(s)
    for family, members in families.items():
        members.sort(key=lambda s: s.ttft_p50_s or 0.0)
        xs = [(s.ttft_p50_s or 0.0) * 1000 for s in members]
        kls = [max(s.kl_mean or 0.0, KL_FLOOR) for s in members]
        same = [(s.same_rate or 0.0) * 100 for s in members]
        colour = _COLOURS.get(family, "tab:purple")
        for key, ax, ys in (("kl", ax_kl, kls), ("same", ax_same, same)):
            ax.plot(xs, ys, "o-" if len(members) > 1 else "o", color=colour, label=family)
            for x, y, s in zip(xs, ys, members, strict=True):
                _label(ax, placed[key], _short(s.system), x, y, log_y=key == "kl")
    ax_kl.set_yscale("log")
    for ax in (ax_kl, ax_same):
        ax.set_xscale("log")
    ax_kl.set_ylabel(f"mean KL(full ‖ system), nats (0 drawn at {KL_FLOOR:g})")
    ax_same.set_ylabel(f"identical greedy continuations of {result.continuation_tokens} tokens (%)")
    ax_same.set_ylim(-5, 105)
    for ax in (ax_kl, ax_same):
        ax.set_xlabel("TTFT p50 (ms, log scale)")
        ax.grid(True, which="both", alpha=0.3)
    if done:
        ax_kl.legend(fontsize=8)
    else:
        ax_kl.text(0.5, 0.5, "no request compared with the reference", ha="center", transform=ax_kl.transAxes)
    fig.suptitle(
        f"{result.workload}: fidelity against time to first token (lower left / upper left is better)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def reuse(result: BenchResult, path: Path) -> None:
    rows = [s for s in result.summaries if s.computed_frac is not None]
    names = [_short(s.system) for s in rows]
    prefix = [(s.prefix_hit_frac or 0) * 100 for s in rows]
    recomputed = [(s.recomputed_frac or 0) * 100 for s in rows]
    moved = [(s.segment_hit_frac or 0) * 100 - r for s, r in zip(rows, recomputed, strict=True)]
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


def write_plots(result: BenchResult, out: Path) -> list[str]:
    """Write the plots into `out`; returns their file names."""
    names = ["frontier.png", "reuse.png"]
    frontier(result, out / names[0])
    reuse(result, out / names[1])
    if result.turns:
        names.append("turns.png")
        turns(result, out / names[2])
    return names
