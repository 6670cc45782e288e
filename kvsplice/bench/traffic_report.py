"""What `kvsplice bench traffic` measured (results.json) and the tables it prints (report.md): per mix,
one row per rate and system. Pure: the driver (traffic.py) fills these from the servers."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvsplice.bench.metrics import percentile
from kvsplice.bench.results import MachineInfo

# Compute's fields and the /metrics counters they are deltas of.
COUNTERS = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefill_flops": "kvsplice:prefill_flops_total",
    "decode_flops": "kvsplice:decode_flops_total",
    "background_flops": "kvsplice:background_flops_total",
    "prefill_tokens": "kvsplice:prefill_tokens_total",
    "background_tokens": "kvsplice:background_tokens_total",
    "prefix_hit_tokens": "kvsplice:prefix_hit_tokens_total",
    "segment_hit_tokens": "kvsplice:segment_hit_tokens_total",
    "discovered_hit_tokens": "kvsplice:discovered_hit_tokens_total",
    "computed_prompt_tokens": "kvsplice:computed_prompt_tokens_total",
    "recomputed_tokens": "kvsplice:recomputed_tokens_total",
    "audit_flops": "kvsplice:audit_flops_total",
}
# Labelled counters, absent from /metrics until their first label: by tier, until a tier below the
# pool first serves a hit; by gate cell, until the trust gate first sees a prompt shape.
LABELLED_COUNTERS = {
    "store_hit_tokens": "kvsplice:store_hit_tokens_total",
    "gate_fallbacks": "kvsplice:gate_fallbacks_total",
}
# Gauges that are all 0 once a server is idle: nothing running, waiting, or queued in the background.
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "kvsplice:background_jobs_queued")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {sample name: value}, summed over labels (one model per server)."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
    return samples


def is_idle(samples: dict[str, float]) -> bool:
    return all(samples[name] == 0 for name in IDLE_GAUGES)


@dataclass(frozen=True)
class Compute:
    """What a server did for one cell, background work included: /metrics counters read when idle
    before and after it, subtracted."""

    prompt_tokens: float
    prefill_flops: float
    decode_flops: float
    background_flops: float
    prefill_tokens: float
    background_tokens: float
    prefix_hit_tokens: float
    segment_hit_tokens: float
    discovered_hit_tokens: float
    computed_prompt_tokens: float
    recomputed_tokens: float
    # Of the background FLOPs, the live audit's and the trust gate's full prefills (0 in runs that
    # predate the count).
    audit_flops: float = 0.0
    # Of the reused tokens, those loaded from a tier below the pool (on replicas sharing Redis: what
    # another replica computed).
    store_hit_tokens: float = 0.0
    # Requests the trust gate prefilled in full (their recompute is in prefill_flops).
    gate_fallbacks: float = 0.0

    @staticmethod
    def delta(before: dict[str, float], after: dict[str, float]) -> Compute:
        values = {name: after[metric] - before[metric] for name, metric in COUNTERS.items()}
        values |= {name: after.get(m, 0.0) - before.get(m, 0.0) for name, m in LABELLED_COUNTERS.items()}
        assert all(v >= 0 for v in values.values()), f"a counter went down: {values}"
        return Compute(**values)

    @property
    def flops(self) -> float:
        return self.prefill_flops + self.decode_flops + self.background_flops

    @property
    def reuse_share(self) -> float:
        """Prompt tokens whose KV was reused (prefix, marked and discovered segments) per prompt token."""
        reused = self.prefix_hit_tokens + self.segment_hit_tokens + self.discovered_hit_tokens
        return reused / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Sent:
    """One request of a cell as the client saw it; times from its scheduled send time."""

    index: int
    scheduled_s: float
    # How late the client actually sent it (its event loop's lag).
    late_s: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class Agreement:
    """Sampled requests of a cell against a full prefill of the same prompt (greedy)."""

    samples: int
    first_token: int
    all_tokens: int


def agreement(reference: dict[int, list[int]], sent: list[Sent]) -> Agreement:
    """Of the requests in `reference` (index: the full prefill's tokens), how many got the same first
    token, and the same tokens throughout (a failed request agrees on nothing)."""
    by_index = {s.index: s.token_ids for s in sent}
    first = same = 0
    for index, ref in reference.items():
        got = by_index[index]
        first += bool(got) and got[:1] == ref[:1]
        same += bool(got) and got == ref
    return Agreement(len(reference), first, same)


@dataclass
class Cell:
    """One system at one rate of one mix."""

    system: str
    mix: str
    rate: float
    # The rate as a multiple of the measured capacity (None when --rates gave it).
    load: float | None
    # From the cell's start to its last answer.
    wall_s: float
    sent: list[Sent]
    compute: Compute
    agreement: Agreement | None = None


@dataclass(frozen=True)
class CellSummary:
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    requests_per_s: float
    output_tokens_per_s: float
    goodput_per_s: float
    # Share of the cell's requests answered with a first token within the SLO.
    within_slo: float
    gflop_per_request: float
    background_share: float
    # Of the compute, the audits' (part of background_share).
    audit_share: float
    # Share of the answered requests the trust gate prefilled in full.
    fallback_share: float
    reuse_share: float
    errors: int


def summarize(cell: Cell, slo_s: float) -> CellSummary:
    """Rates are per second of the cell's wall time; goodput counts requests whose TTFT met slo_s
    (a failed request never does); compute is per answered request."""
    ok = [s for s in cell.sent if s.error is None and s.ttft_s is not None]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    good = sum(t <= slo_s for t in ttfts)
    c = cell.compute
    return CellSummary(
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        requests_per_s=len(ok) / cell.wall_s,
        output_tokens_per_s=sum(s.completion_tokens for s in ok) / cell.wall_s,
        goodput_per_s=good / cell.wall_s,
        within_slo=good / len(cell.sent) if cell.sent else 0.0,
        gflop_per_request=c.flops / len(ok) / 1e9 if ok else 0.0,
        background_share=c.background_flops / c.flops if c.flops else 0.0,
        audit_share=c.audit_flops / c.flops if c.flops else 0.0,
        fallback_share=c.gate_fallbacks / len(ok) if ok else 0.0,
        reuse_share=c.reuse_share,
        errors=len(cell.sent) - len(ok),
    )


@dataclass(frozen=True)
class Calibration:
    """Idle single requests of new passages (median over a few, each under a salt of its own)."""

    prompt_tokens: float
    # Per system.
    ttft_s: dict[str, float]
    e2e_s: dict[str, float]
    # Requests/s one server sustains: 1 / the radix system's idle request time.
    capacity_per_s: float
    # The SLO: slo_factor x the radix system's idle TTFT.
    slo_factor: float
    slo_s: float


@dataclass(frozen=True)
class MixInfo:
    name: str
    description: str
    pool: int
    zipf: float
    first_seen_share: float
    requests: int


@dataclass
class TrafficResult:
    command: str
    machine: MachineInfo
    config: dict[str, Any]
    calibration: Calibration
    mixes: list[MixInfo]
    cells: list[Cell]
    notes: list[str] = field(default_factory=list)
    started: str = ""
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def run_lines(result: TrafficResult) -> list[str]:
    """The command and the machine, as a report's first lines say them."""
    m = result.machine
    return [
        f"Command: `{result.command or '(Python API)'}`",
        f"Machine: {m.cpu}, {m.cores} CPUs, torch {m.torch_version}; git {m.git_commit}"
        + (f" (modified: {', '.join(m.git_modified)})" if m.git_modified else "")
        + f"; load average at the start {m.load_start} and the end {m.load_end}. "
        f"Started {result.started}, took {result.wall_s / 60:.1f} min.",
    ]


def render(result: TrafficResult, setup: list[str] | None = None, baseline: str = "radix") -> str:
    """The report: `setup` (the title and how the systems were run; default: bench traffic's three
    servers), then one table per mix with compute as a ratio to the `baseline` system's."""
    lines = _traffic_setup(result) if setup is None else setup
    for mix in result.mixes:
        lines += _mix_table(result, mix, baseline)
    if result.notes:
        lines += ["", "Notes:", *(f"- {note}" for note in result.notes)]
    return "\n".join(lines) + "\n"


def _traffic_setup(result: TrafficResult) -> list[str]:
    cal, cfg = result.calibration, result.config
    return [
        "# Sustained traffic: splice, radix and hash under open-loop Poisson load",
        "",
        *run_lines(result),
        f"Servers: `kvsplice serve` {' '.join(cfg['server_flags']) or '(defaults)'}, one per system, "
        "all up at once, one cell at a time (the systems in a rotated order per rate). "
        "splice = `--prefix-cache radix` (auto_segments on), radix = `--prefix-cache radix "
        "--no-auto-segments`, hash = `--prefix-cache hash --no-auto-segments`.",
        f"Requests: chat messages ({markup(cfg)}), {cfg['docs']} passages of at most "
        f"{cfg['doc_words']} words and a question each, max_tokens={cfg['max_tokens']}, temperature 0, "
        f"streamed; {cfg['requests']} per cell, sent open-loop at Poisson arrival times; a fresh "
        "cache_salt per mix and rate, so no cell reuses another's KV.",
        f"Calibration (idle, new passages, {cal.prompt_tokens:.0f} prompt tokens, median): "
        + ", ".join(f"{s} TTFT {cal.ttft_s[s]:.2f} s / request {cal.e2e_s[s]:.2f} s" for s in cal.ttft_s)
        + f". Capacity = 1 / radix's request time = {cal.capacity_per_s:.3f} requests/s.",
        f"**SLO: TTFT <= {cal.slo_s:.2f} s** ({cal.slo_factor:g} x radix's idle TTFT). Goodput = requests "
        "within the SLO per second of the cell's wall time (first send to last answer).",
        "Compute = FLOPs of prefills, decode steps and background work (the segment store's contexts and "
        "lead KV, and the audits: the trust gate's samples), from the server's /metrics read idle before "
        "and after the cell, per answered request. Audits = the audits' share of the compute (part of "
        "background). Fell back = answered requests the trust gate prefilled in full. "
        "Reused = prompt tokens whose KV was reused (prefix, segment and discovered hits) / prompt tokens. "
        "Fidelity: sampled requests of the cell's second half against a full prefill of the same prompt "
        "(the hash server under a fresh salt), greedy tokens compared; KL is not measured (the server "
        "refuses logprobs).",
    ]


def _mix_table(result: TrafficResult, mix: MixInfo, baseline: str) -> list[str]:
    cal = result.calibration
    lines = [
        "",
        f"## {mix.name}: {mix.description}",
        "",
        f"Pool {mix.pool} passages, Zipf exponent {mix.zipf:g}: {mix.first_seen_share:.0%} of the "
        f"passage slots of a cell's {mix.requests} requests carry a passage seen for the first time.",
        "",
        "| rate (req/s) | load | system | TTFT p50 | TTFT p99 | req/s | out tok/s | goodput (req/s) "
        f"| within SLO | GFLOP/request | background | audits | fell back | compute vs {baseline} | reused "
        "| first token = ref | all tokens = ref | errors |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cells = [c for c in result.cells if c.mix == mix.name]
    for rate in sorted({c.rate for c in cells}):
        row_cells = sorted((c for c in cells if c.rate == rate), key=lambda c: c.system)
        summaries = {c.system: summarize(c, cal.slo_s) for c in row_cells}
        base = summaries.get(baseline)
        for c in row_cells:
            s, a = summaries[c.system], c.agreement
            lines.append(
                f"| {rate:.3f} | {'-' if c.load is None else f'{c.load:g}x'} | {c.system} "
                f"| {_s(s.ttft_p50_s)} | {_s(s.ttft_p99_s)} | {s.requests_per_s:.3f} "
                f"| {s.output_tokens_per_s:.2f} | {s.goodput_per_s:.3f} | {s.within_slo:.0%} "
                f"| {s.gflop_per_request:.1f} | {s.background_share:.0%} | {s.audit_share:.0%} "
                f"| {s.fallback_share:.0%} "
                f"| {_ratio(s.gflop_per_request, base.gflop_per_request) if base else '-'} "
                f"| {s.reuse_share:.0%} "
                f"| {f'{a.first_token}/{a.samples}' if a else '-'} "
                f"| {f'{a.all_tokens}/{a.samples}' if a else '-'} | {s.errors} |"
            )
    return lines


def write(result: TrafficResult, out: Path, report: str | None = None) -> str:
    """DIR/report.md (`report`, default: render(result)) and DIR/results.json; returns the report."""
    out.mkdir(parents=True, exist_ok=True)
    report = render(result) if report is None else report
    (out / "report.md").write_text(report)
    (out / "results.json").write_text(result.to_json() + "\n")
    return report


def markup(cfg: dict[str, Any]) -> str:
    """How the run's messages carried their passages."""
    return "each passage a content part marked as a segment" if cfg.get("marked") else "plain, no markup"
