"""`kvsplice bench traffic`: the workload, the schedule, the metric deltas, goodput and the report without
a server; one slow smoke test against the real servers."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pytest

from kvsplice.bench import traffic
from kvsplice.bench.corpus import Corpus
from kvsplice.bench.results import MachineInfo
from kvsplice.bench.synth import Passage
from kvsplice.bench.traffic import TrafficConfig, fidelity_sample, rotated, server_flags
from kvsplice.bench.traffic_report import (
    COUNTERS,
    Agreement,
    Calibration,
    Cell,
    Compute,
    MixInfo,
    Sent,
    TrafficResult,
    agreement,
    is_idle,
    parse_metrics,
    render,
    summarize,
    write,
)
from kvsplice.bench.traffic_workload import (
    MIXES,
    TrafficRequest,
    build_requests,
    first_seen_share,
    poisson_schedule,
    zipf_draw,
    zipf_weights,
)
from kvsplice.cli import main
from kvsplice.config import EngineConfig

CORPUS = Corpus(
    "test",
    tuple(
        Passage(f"Title {i}", f"Passage {i} says {i} things. It has a second sentence.") for i in range(800)
    ),
)


def test_zipf_draw_is_distinct_and_follows_the_weights() -> None:
    rng = random.Random(0)
    weights = zipf_weights(5, 1.0)
    for _ in range(50):
        drawn = zipf_draw(rng, weights, 3)
        assert len(set(drawn)) == 3 and all(0 <= i < 5 for i in drawn)
    # One at a time, rank r is drawn with probability w_r / sum(w): 1/r over 1 + 1/2 + ... + 1/5.
    counts = Counter(zipf_draw(rng, weights, 1)[0] for _ in range(20000))
    for rank, weight in enumerate(weights):
        assert counts[rank] / 20000 == pytest.approx(weight / sum(weights), abs=0.015)
    with pytest.raises(ValueError):
        zipf_draw(rng, weights, 6)


def test_requests_are_plain_chat_with_k_passages_and_the_mixes_differ() -> None:
    popular = build_requests(MIXES["popular"], 12, 4, 50, 0, CORPUS)
    assert popular == build_requests(MIXES["popular"], 12, 4, 50, 0, CORPUS)
    for request in popular:
        system, user = request.messages
        assert system["role"] == "system" and user["role"] == "user"
        assert len(set(request.passage_ids)) == 4 and user["content"].count(" says ") == 4
        assert user["content"].rstrip().split("\n")[-1].startswith("Question: ")
    novel = build_requests(MIXES["novel"], 12, 4, 50, 0, CORPUS)
    assert first_seen_share(popular) <= 10 / 48 < 0.8 < first_seen_share(novel)


def test_first_seen_share_counts_slots_no_earlier_request_carried() -> None:
    requests = [TrafficRequest(ids, ()) for ids in [(1, 2), (2, 3), (3, 1), (4, 5)]]
    # New: 1, 2 | 3 | - | 4, 5.
    assert first_seen_share(requests) == 5 / 8
    assert first_seen_share([]) == 0.0


def test_poisson_schedule_starts_at_zero_and_has_mean_gap_one_over_rate() -> None:
    times = poisson_schedule(2.0, 4000, random.Random(1))
    assert times[0] == 0.0 and len(times) == 4000
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) > 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.05)
    # Exponential gaps: about e^-1 of them exceed the mean.
    assert sum(g > 0.5 for g in gaps) / len(gaps) == pytest.approx(0.368, abs=0.03)
    with pytest.raises(ValueError):
        poisson_schedule(0.0, 3, random.Random(0))


def _metrics_text(values: dict[str, float], running: int = 0) -> str:
    lines = []
    for metric, value in values.items():
        family = metric.removesuffix("_total")
        lines += [f"# TYPE {family} counter", f'{metric}{{model_name="m"}} {value}']
    for gauge in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "kvsplice:background_jobs_queued",
    ):
        lines += [f"# TYPE {gauge} gauge", f'{gauge}{{model_name="m"}} {running}']
    return "\n".join(lines) + "\n"


def test_compute_is_the_counters_delta_with_background_work() -> None:
    before = parse_metrics(_metrics_text({metric: 10.0 for metric in COUNTERS.values()}))
    after_values = {metric: 10.0 for metric in COUNTERS.values()}
    after_values |= {
        "vllm:prompt_tokens_total": 1010.0,
        "kvsplice:prefix_hit_tokens_total": 110.0,
        "kvsplice:discovered_hit_tokens_total": 510.0,
        "kvsplice:prefill_flops_total": 3e9 + 10,
        "kvsplice:decode_flops_total": 1e9 + 10,
        "kvsplice:background_flops_total": 2e9 + 10,
        "kvsplice:audit_flops_total": 5e8 + 10,
    }
    # The gate's fallbacks, absent before the gate saw a shape: one cell, then 3 of them.
    after = parse_metrics(_metrics_text(after_values | {"kvsplice:gate_fallbacks_total": 3.0}))
    assert is_idle(after) and not is_idle(parse_metrics(_metrics_text({}, running=1)))
    compute = Compute.delta(before, after)
    assert compute.prompt_tokens == 1000 and compute.segment_hit_tokens == 0
    assert compute.flops == pytest.approx(6e9)
    assert compute.audit_flops == pytest.approx(5e8) and compute.gate_fallbacks == 3
    assert compute.reuse_share == pytest.approx(0.6)
    with pytest.raises(AssertionError, match="went down"):
        Compute.delta(after, before)


def _compute(
    flops: float, background: float = 0.0, reused: float = 0.0, audits: float = 0.0, fallbacks: int = 0
) -> Compute:
    return Compute(
        1000, flops, 0, background, 1000, 0, reused, 0, 0, 1000 - reused, 0,
        audit_flops=audits, gate_fallbacks=fallbacks,
    )  # fmt: skip


def _sent(index: int, ttft: float | None, tokens: list[int], error: str | None = None) -> Sent:
    return Sent(index, index * 1.0, 0.0, ttft, (ttft or 0) + 1, 100, len(tokens), tokens, error)


def test_goodput_counts_requests_within_the_slo_per_second_and_failures_never() -> None:
    sent = [_sent(0, 0.5, [1, 2]), _sent(1, 1.0, [1, 2]), _sent(2, 5.0, [1, 2]), _sent(3, None, [], "429")]
    cell = Cell("splice", "popular", 1.0, 1.0, 10.0, sent, _compute(6e9, 1.5e9, 400, audits=6e8, fallbacks=1))
    s = summarize(cell, slo_s=2.0)
    assert s.errors == 1 and s.within_slo == 0.5
    assert s.goodput_per_s == pytest.approx(0.2) and s.requests_per_s == pytest.approx(0.3)
    assert s.output_tokens_per_s == pytest.approx(0.6)
    assert s.ttft_p50_s == 1.0 and s.ttft_p99_s == pytest.approx(4.92)
    assert s.gflop_per_request == pytest.approx(2.5)  # 7.5 GFLOP over 3 answered requests
    assert s.background_share == pytest.approx(0.2) and s.reuse_share == pytest.approx(0.4)
    assert s.audit_share == pytest.approx(0.08) and s.fallback_share == pytest.approx(1 / 3)


def test_agreement_compares_first_and_all_tokens_with_the_reference() -> None:
    sent = [
        _sent(0, 1.0, [5, 6, 7]),
        _sent(1, 1.0, [5, 9, 7]),
        _sent(2, 1.0, [4, 6, 7]),
        _sent(3, None, [], "x"),
    ]
    reference = {0: [5, 6, 7], 1: [5, 6, 7], 2: [5, 6, 7], 3: [5, 6, 7]}
    assert agreement(reference, sent) == Agreement(samples=4, first_token=2, all_tokens=1)


def _result() -> TrafficResult:
    calibration = Calibration(
        600, {"radix": 1.0, "splice": 1.0}, {"radix": 2.0, "splice": 2.0}, 0.5, 3.0, 3.0
    )
    cells = []
    for rate, load in ((1.0, 2.0), (0.125, 0.25)):
        for system, flops in (("splice", 2e9), ("radix", 8e9)):
            sent = [_sent(0, 0.4, [1]), _sent(1, 4.0, [1])]
            cells.append(Cell(system, "popular", rate, load, 4.0, sent, _compute(flops), Agreement(1, 1, 0)))
    mix = MixInfo("popular", "a small pool", 10, 1.0, 0.25, 2)
    config = {
        "server_flags": ["--kv-cache-gb", "1"],
        "docs": 4,
        "doc_words": 100,
        "max_tokens": 8,
        "requests": 2,
    }
    return TrafficResult("kvsplice bench traffic", MachineInfo.collect(), config, calibration, [mix], cells)


def test_report_has_a_row_per_rate_and_system_with_ratios_to_radix(tmp_path) -> None:
    report = render(_result())
    assert "SLO: TTFT <= 3.00 s" in report and "25% of the passage slots" in report
    rows = [line for line in report.splitlines() if line.startswith("| 0.") or line.startswith("| 1.")]
    assert [row.split(" | ")[:3] for row in rows] == [
        ["| 0.125", "0.25x", "radix"],
        ["| 0.125", "0.25x", "splice"],
        ["| 1.000", "2x", "radix"],
        ["| 1.000", "2x", "splice"],
    ]
    splice = rows[1].split(" | ")
    # 2 GFLOP over 2 requests = 1.0 per request, a quarter of radix's; one of two within the SLO.
    assert splice[9] == "1.0" and splice[10:14] == ["0%", "0%", "0%", "0.25x"] and splice[8] == "50%"
    assert splice[15:17] == ["1/1", "0/1"]
    write(_result(), tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["cells"]) == 4 and saved["calibration"]["slo_s"] == 3.0
    assert (tmp_path / "report.md").read_text().startswith("# Sustained traffic")


def test_server_flags_pass_changed_engine_options_and_refuse_tiers() -> None:
    flags = server_flags(EngineConfig(model="smollm2", num_threads=2, auto_segments=False), 1.5)
    assert flags == ["--kv-cache-gb", "1.5", "--model", "smollm2", "--num-threads", "2"]
    assert server_flags(EngineConfig(max_num_seqs=4, prefix_cache="hash"), 1) == [
        "--kv-cache-gb", "1", "--max-num-seqs", "4",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="store"):
        server_flags(EngineConfig(store={"store_dir": "/tmp/x"}), 1)


def test_config_checks_and_turns() -> None:
    with pytest.raises(ValueError, match="unknown mix"):
        TrafficConfig(mixes=("popular", "viral"))
    with pytest.raises(ValueError, match="rates"):
        TrafficConfig(rates=(0.5, 0.0))
    for bad in (["--mixes", "viral"], ["--rates", "-1"], ["--systems", "hash"], ["--docs", "2", "4"]):
        assert main(["bench", "traffic", *bad]) == 2
    assert [rotated(["a", "b", "c"], t)[0] for t in range(4)] == ["a", "b", "c", "a"]
    sample = fidelity_sample(12, random.Random(0))
    assert len(sample) == 3 == len(set(sample)) and all(6 <= i < 12 for i in sample)
    assert fidelity_sample(2, random.Random(0)) == [1]


@pytest.mark.slow
def test_traffic_against_real_servers(monkeypatch) -> None:
    """Three real servers, the default model, one rate, two requests of short passages (about 60 s)."""
    monkeypatch.setattr(traffic, "CALIBRATION_REQUESTS", 1)
    config = TrafficConfig(
        mixes=("popular",), rates=(1.0,), requests=2, docs=2, doc_words=30, max_tokens=4,
        server_flags=("--kv-cache-gb", "0.25"),
    )  # fmt: skip
    result = traffic.run_traffic(config)
    assert {c.system for c in result.cells} == {"splice", "radix", "hash"}
    for cell in result.cells:
        assert [s.error for s in cell.sent] == [None, None]
        assert all(s.ttft_s is not None and len(s.token_ids) == 4 for s in cell.sent)
        # The server's counters saw exactly the cell's requests, background work done.
        assert cell.compute.prompt_tokens == sum(s.prompt_tokens for s in cell.sent) > 0
        assert cell.compute.decode_flops > 0 and cell.agreement is not None and cell.agreement.samples == 1
        assert 0 <= cell.compute.audit_flops <= cell.compute.background_flops
    assert "| 1.000 | - | splice |" in render(result)


def test_marked_requests_carry_each_passage_as_a_segment_part() -> None:
    from kvsplice.bench import corpus as corpora
    from kvsplice.bench.traffic_workload import MIXES, build_requests

    source = corpora.load("synthetic")
    plain = build_requests(MIXES["popular"], 5, 4, 50, 0, source)
    marked = build_requests(MIXES["popular"], 5, 4, 50, 0, source, marked=True)
    for p, m in zip(plain, marked, strict=True):
        assert p.passage_ids == m.passage_ids
        parts = m.messages[1]["content"]
        segments = [part["text"] for part in parts if part.get("kvsplice_segment")]
        assert len(segments) == 4
        # The same text either way: the parts as the server joins them are the plain message.
        assert "\n".join(part["text"] for part in parts) == p.messages[1]["content"]
