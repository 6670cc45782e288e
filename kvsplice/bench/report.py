"""The markdown report of a bench run (DIR/report.md; its headline on stdout), and writing a run's files."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvsplice.bench.metrics import (
    ALL,
    KL_CLOSE,
    SURE_MARGIN,
    GroupSummary,
    SystemSummary,
    TurnSummary,
    by_group,
)
from kvsplice.bench.results import BenchResult
from kvsplice.bench.stats import Z95, Interval

HEADLINE_LEGEND = (
    "TTFT p50: median time to first token. speedup: median over requests of the full prefill's TTFT "
    "over the system's. reused: share of the prompt tokens whose KV was reused rather than computed "
    "(from the prefix cache, the segment store, or spans found without markup). computed: share of "
    "the prompt tokens computed, counting reused tokens that repair recomputed (they count in both). "
    "total compute: FLOPs spent on the request, with the work the engine did for it in the "
    "background, as a share of the full prefill's. KL: mean KL divergence of the first generated "
    "token's distribution from the full prefill's, in nats (0: the same). first token: share of "
    "requests whose most likely first token is the full prefill's. same continuation: share whose "
    "greedy continuation of {continuation} tokens is the full prefill's, token for token."
)
LEGEND = (
    "TTFT: time to first token (p50, p95); speedup: median over requests of the full prefill's TTFT "
    "over the system's. computed: prompt tokens computed plus reused tokens recomputed by repair, as a "
    "share of the prompt tokens; FLOPs: estimated prefill FLOPs as a share of the full prefill's; with "
    "background: the same plus what the engine computed in the background for the request (contexts and "
    "lead KV of stored segments). "
    "prefix / segment: prompt tokens reused from the prefix cache (for splice systems, possibly an "
    "earlier request's spliced KV of the same prompt start) / moved from the segment "
    "store. store fill: tokens computed after the first token to put missed segments into the store "
    "(and to compute stored ones after more contexts, segment_contexts > 1), as a share of the prompt "
    "tokens. KL: mean KL(full ‖ system) of the next-token distribution at "
    "the first generated position, in nats; KL ≤ {close}: share of requests within {close} nats of the "
    "full prefill; top-1: same most likely first token; same N: identical "
    "greedy continuation of N tokens; match: mean leading tokens of the continuation equal to the full "
    "prefill's. accuracy: the answer appears in the first line of the "
    "continuation (recall: the continuation starts with it). peak KV: most KV memory the system held "
    "while a request ran (docs/bench.md)."
)
BREAKDOWN_LEGEND = (
    "accuracy: the continuation starts with the answer, with its 95% Wilson interval. Δ vs "
    "{reference}: accuracy minus the full prefill's on the same requests, in points, with its 95% "
    "interval for paired outcomes (Newcombe's score method): an interval below 0 is a loss the run "
    "shows, one that spans 0 is not told apart from none. KL, top-1 and match as above; the first "
    "generated token is the answer's own first token, so top-1 says whether the system would answer "
    "as the full prefill does. top-1 (sure): the same over the requests (their number in brackets) "
    "whose full prefill gave its first token at least {sure:g} more probability than the runner-up; "
    "where it gave less, the full prefill itself is torn between two answers."
)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.0f}"


def _pct(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value * 100:.{digits}f}%"


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _kl(value: float | None) -> str:
    if value is None:
        return "–"
    if value == 0:
        return "0"
    return f"{value:.2e}" if value < 1e-3 else f"{value:.4f}"


def _mib(value: int | None) -> str:
    if value is None:
        return "–"
    mib = value / 2**20
    return f"{mib:,.0f}" if mib >= 10 else f"{mib:.2f}"


HEADLINE_COLUMNS = (
    "TTFT p50 (ms)",
    "speedup",
    "reused",
    "computed",
    "total compute",
    "KL",
    "first token",
    "same continuation",
)


def _reused(s: SystemSummary) -> float | None:
    parts = (s.prefix_hit_frac, s.segment_hit_frac, s.discovered_hit_frac)
    return None if all(p is None for p in parts) else sum(p or 0.0 for p in parts)


def headline_table(summaries: list[SystemSummary]) -> str:
    """Is it faster, and is it the same: a row per system, against the full prefill."""
    rows = ["| system | " + " | ".join(HEADLINE_COLUMNS) + " |", "|---|" + "---:|" * len(HEADLINE_COLUMNS)]
    for s in summaries:
        name = s.system + (f" (**{s.failed} of {s.requests} failed**)" if s.failed else "")
        if s.failed == s.requests and s.requests:
            rows.append(f"| {name} |" + " failed |" * len(HEADLINE_COLUMNS))
            continue
        cells = [
            _ms(s.ttft_p50_s),
            _times(s.speedup_p50),
            _pct(_reused(s), 1),
            _pct(s.computed_frac, 1),
            _pct(s.total_flops_frac, 1),
            _kl(s.kl_mean),
            _pct(s.top1_rate),
            _pct(s.same_rate),
        ]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary_table(summaries: list[SystemSummary], continuation: int) -> str:
    header = (
        "| system | done | TTFT p50 ms | TTFT p95 ms | speedup | computed | FLOPs | with background "
        "| prefix | segment "
        f"| found | store fill | KL | KL ≤ {KL_CLOSE:g} | top-1 | same {continuation} | match | accuracy "
        "| peak KV MiB |"
    )
    rows = [header, "|---|---|" + "---:|" * 17]
    for s in summaries:
        done = f"{s.requests - s.failed}/{s.requests}" + (f" (**{s.failed} failed**)" if s.failed else "")
        if s.failed == s.requests and s.requests:
            rows.append(f"| {s.system} | {done} |" + " failed |" * 17)
            continue
        cells = [
            _ms(s.ttft_p50_s),
            _ms(s.ttft_p95_s),
            _times(s.speedup_p50),
            _pct(s.computed_frac, 1),
            _pct(s.flops_frac, 1),
            _pct(s.total_flops_frac, 1),
            _pct(s.prefix_hit_frac, 1),
            _pct(s.segment_hit_frac, 1),
            _pct(s.discovered_hit_frac, 1),
            _pct(s.store_fill_frac, 1),
            _kl(s.kl_mean),
            _pct(s.close_rate),
            _pct(s.top1_rate),
            _pct(s.same_rate),
            "–" if s.matched_mean is None else f"{s.matched_mean:.1f}",
            _pct(s.accuracy),
            _mib(s.peak_kv_bytes),
        ]
        rows.append(f"| {s.system} | {done} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


STORE_LEGEND = (
    "segment: prompt tokens moved from the segment store, as above; from <tier>: those loaded into the "
    "pool from that tier for this request (the rest were in the pool already); load ms: mean per "
    "request of the time spent reading, verifying and decoding them (part of the TTFT). Tier counters "
    "at the end of the run: hits and misses are segment lookups below the pool; corrupt: entries that "
    "failed verification (deleted, never served); errors: failed tier operations; dropped: writes "
    "dropped (queue full or over budget)."
)


def store_tables(summaries: list[SystemSummary], tier_stats: dict[str, dict[str, dict[str, float]]]) -> str:
    """Where each system's segments came from, and each engine's tier counters."""
    tiers = sorted({t for per_engine in tier_stats.values() for t in per_engine})
    head = "| system | TTFT p50 ms | segment | " + " | ".join(f"from {t}" for t in tiers) + " | load ms |"
    rows = [head, "|---|---:|---:|" + "---:|" * len(tiers) + "---:|"]
    for s in summaries:
        if not s.segment_hit_frac and not s.tier_hit_frac:
            continue
        cells = [_ms(s.ttft_p50_s), _pct(s.segment_hit_frac, 1)]
        cells += [_pct(s.tier_hit_frac.get(t, 0.0), 1) for t in tiers]
        cells.append("–" if s.store_load_mean_s is None else f"{s.store_load_mean_s * 1000:,.1f}")
        rows.append(f"| {s.system} | " + " | ".join(cells) + " |")
    counters = [
        "| engine | tier | hits | misses | corrupt | errors | MiB read | MiB written | writes | dropped |",
        "|---|---|" + "---:|" * 8,
    ]
    for engine, per_tier in tier_stats.items():
        for tier, c in per_tier.items():
            counters.append(
                f"| {engine} | {tier} | {c['hits']:,.0f} | {c['misses']:,.0f} | {c['corrupt']:,.0f} "
                f"| {c['errors']:,.0f} | {c['bytes_read'] / 2**20:,.1f} | {c['bytes_written'] / 2**20:,.1f} "
                f"| {c['writes']:,.0f} | {c['dropped_writes']:,.0f} |"
            )
    return "\n".join(rows) + "\n\n" + "\n".join(counters)


def _interval(value: Interval | None) -> str:
    if value is None:
        return "–"
    return f"{value.estimate * 100:.0f}% [{value.low * 100:.0f}–{value.high * 100:.0f}]"


def _points(value: Interval | None) -> str:
    if value is None:
        return "–"
    return f"{value.estimate * 100:+.0f} [{value.low * 100:+.0f}, {value.high * 100:+.0f}]"


def breakdown_tables(rows: list[GroupSummary], reference: str) -> str:
    """A table per setting (and one over all settings): per answer position, a row per system."""
    head = (
        f"| position | system | done | accuracy [95% CI] | Δ vs {reference} [95% CI] | KL "
        f"| KL ≤ {KL_CLOSE:g} | top-1 | top-1 (sure) | match |"
    )
    tables: dict[str, list[str]] = {}
    for row in rows:
        lines = tables.setdefault(row.setting, [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"])
        done = f"{row.requests - row.failed}/{row.requests}"
        cells = [
            _interval(row.accuracy),
            "–" if row.system == reference else _points(row.accuracy_diff),
            _kl(row.kl_mean),
            _pct(row.close_rate),
            _pct(row.top1_rate),
            "–" if row.system == reference else f"{_pct(row.top1_sure_rate)} ({row.sure})",
            "–" if row.matched_mean is None else f"{row.matched_mean:.1f}",
        ]
        lines.append(f"| {row.answer_position} | {row.system} | {done} | " + " | ".join(cells) + " |")
    return "\n\n".join(
        f"#### {'All settings' if setting == ALL else setting}\n\n" + "\n".join(lines)
        for setting, lines in tables.items()
    )


def turn_tables(turns: list[TurnSummary], systems: list[str]) -> str:
    """Tables with a row per turn: TTFT p50 (ms) per system, tokens computed per system, and each
    compared system's first-token KL from the full prefill (does a later turn drift?)."""
    by_turn: dict[int, dict[str, TurnSummary]] = {}
    for row in turns:
        by_turn.setdefault(row.turn, {})[row.system] = row
    head = "| turn | prompt tokens | " + " | ".join(systems) + " |"
    rule = "|---:|---:|" + "---:|" * len(systems)

    def table(cell: str) -> str:
        lines = [head, rule]
        for turn, cells in sorted(by_turn.items()):
            prompt = next((c.prompt_tokens_mean for c in cells.values() if c.prompt_tokens_mean), None)
            values = []
            for name in systems:
                c = cells.get(name)
                if c is None or c.requests == 0:
                    values.append("–")
                elif c.failed == c.requests:
                    values.append("failed")
                else:
                    mark = f" ({c.failed} failed)" if c.failed else ""
                    values.append(_turn_cell(c, cell) + mark)
            lines.append(f"| {turn} | {prompt or 0:,.0f} | " + " | ".join(values) + " |")
        return "\n".join(lines)

    return (
        "TTFT p50 (ms) per turn:\n\n"
        + table("ttft")
        + "\n\nPrompt tokens computed per turn (mean; computed plus recomputed):\n\n"
        + table("computed")
        + "\n\nFirst-token KL from the full prefill per turn (mean [95 % interval]; same first token):\n\n"
        + table("kl")
    )


def _turn_cell(c: TurnSummary, cell: str) -> str:
    if cell == "ttft":
        return _ms(c.ttft_p50_s)
    if cell == "computed":
        return f"{c.computed_mean or 0:,.0f}"
    if c.kl_mean is None:
        return "–"
    spread = ""
    if c.kl_se is not None:
        spread = f" [{max(0.0, c.kl_mean - Z95 * c.kl_se):.4f}, {c.kl_mean + Z95 * c.kl_se:.4f}]"
    return f"{c.kl_mean:.4f}{spread}; {_pct(c.top1_rate, 0)}"


def headline(result: BenchResult) -> str:
    """The report's opening, all the terminal shows by default: the run, the headline table and
    its legend, and the failures if any."""
    r, m = result, result.machine
    spec = r.spec
    measured = sum(1 for x in r.records if x.system == r.systems[0] and not x.warmup)
    warmups = len({x.request_id for x in r.records if x.warmup})
    sizes = ", ".join(f"{k}={v}" for k, v in spec.items() if v is not None)
    corpus = {
        "musique": "MuSiQue passages from ../shared/data/musique_s.json",
        "synthetic": "the synthetic corpus shipped in kvsplice/data/",
    }.get(r.corpus, r.corpus)
    load = "" if m.load_start is None else f"; load average {_load(m.load_start)} at the start"
    if m.load_end is not None:
        load += f", {_load(m.load_end)} at the end"
    lines = [
        f"# kvsplice bench: {r.workload}",
        "",
        f"`{r.command}` · started {r.started} · {r.wall_s / 60:.1f} min",
        "",
        f"**Workload.** {r.description}. Text: {corpus}. {measured} measured requests"
        + (f" after {warmups} warm-up requests" if warmups else "")
        + f" ({sizes}). Greedy continuations of {r.continuation_tokens} tokens.",
        "",
        f"**Machine.** {m.cpu}, {m.cores} cores, torch {m.torch_version} ({m.torch_threads} "
        f"thread{'s' if m.torch_threads != 1 else ''}), "
        f"Python {m.python}, {m.platform}{load}."
        + (f" kvsplice commit {m.git_commit}" if m.git_commit else "")
        + (f" with uncommitted changes to {', '.join(m.git_modified)}" if m.git_modified else "")
        + ("." if m.git_commit else ""),
    ]
    if r.model is not None:
        mo = r.model
        lines += [
            "",
            f"**Model.** {mo.name}: {mo.architecture}, {_count(mo.parameters)} parameters, {mo.layers} "
            f"layers, {mo.dtype} compute, {mo.kv_dtype} KV ({mo.kv_bytes_per_token / 1024:.0f} KiB per "
            f"token), blocks of {mo.block_size} tokens. KV pools: "
            + ", ".join(f"{k} {v:.2f} GiB" for k, v in r.kv_pools_gib.items())
            + ".",
        ]
    lines += [
        "",
        "## Side by side",
        "",
        f"Reference: `{r.systems[0]}`, a full prefill of the same prompt in the same run.",
        "",
        headline_table(r.summaries),
        "",
        HEADLINE_LEGEND.format(continuation=r.continuation_tokens),
    ]
    failures = Counter((x.system, x.error) for x in r.records if x.error is not None)
    if failures:
        lines += ["", "## Failures", ""]
        lines += [f"- `{system}`: {count}× {error}" for (system, error), count in failures.items()]
    return "\n".join(lines) + "\n"


def details(result: BenchResult, plots: list[str] | None = None) -> str:
    """The rest of the report: every column, then the sections the run has."""
    r = result
    lines = [
        "## Details",
        "",
        "### Every column",
        "",
        summary_table(r.summaries, r.continuation_tokens),
        "",
        LEGEND.format(close=f"{KL_CLOSE:g}"),
    ]
    if r.tier_stats:
        lines += ["", "### Store tiers", "", store_tables(r.summaries, r.tier_stats), "", STORE_LEGEND]
    if r.turns:
        lines += ["", "### Per turn", "", turn_tables(r.turns, r.systems)]
    groups = by_group(r.records, r.systems)
    if groups:
        lines += [
            "",
            "### By setting and answer position",
            "",
            breakdown_tables(groups, r.systems[0]),
            "",
            BREAKDOWN_LEGEND.format(reference=r.systems[0], sure=SURE_MARGIN),
        ]
    if r.notes:
        lines += ["", "### Notes", ""] + [f"- {note}" for note in r.notes]
    if plots:
        lines += ["", "### Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def markdown(result: BenchResult, plots: list[str] | None = None) -> str:
    """The whole report: the headline, then the details."""
    return headline(result) + "\n" + details(result, plots)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _load(values: tuple[float, float, float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def write(result: BenchResult, out: Path, plots: bool = True) -> str:
    """Write results.json, the plots and report.md into `out`; returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    result.write_json(out / "results.json")
    names: list[str] = []
    if plots:
        from kvsplice.bench.plots import write_plots

        names = write_plots(result, out)
    report = markdown(result, names)
    (out / "report.md").write_text(report)
    return report
