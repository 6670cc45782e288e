"""The bench's metric code on hand-made inputs (KL, agreement, percentiles, summaries with failures),
system names, prompt materialisation and the report. No model."""

from __future__ import annotations

import math

import pytest
import torch

from kvsplice.bench.base import BenchRequest, Doc
from kvsplice.bench.metrics import (
    KL_CLOSE,
    RequestRecord,
    close_rate,
    compare,
    first_line,
    is_correct,
    kl_divergence,
    per_turn,
    percentile,
    summarize,
    top1_agree,
)
from kvsplice.bench.report import HEADLINE_COLUMNS, markdown, summary_table
from kvsplice.bench.results import BenchResult, MachineInfo
from kvsplice.bench.systems import (
    SWEEP_BUDGETS,
    WordHashEncoder,
    default_systems,
    name_parts,
    parse_systems,
    prompt_parts,
)
from kvsplice.config import EngineConfig
from kvsplice.prompt import Segment
from kvsplice.repair.registry import POLICY_NAMES


def test_kl_of_known_distributions() -> None:
    p = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
    q = torch.tensor([0.9, 0.1], dtype=torch.float64).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-9)
    # KL(P || Q) is not symmetric: the reference is the first argument.
    reverse = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert kl_divergence(q, p) == pytest.approx(reverse, rel=1e-9)


def test_kl_is_zero_for_equal_and_shifted_logits_and_positive_otherwise() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert kl_divergence(logits, logits) == 0.0
    assert kl_divergence(logits, logits + 7.5) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(logits, logits * 1.1) > 0


def test_kl_handles_float32_logits_of_a_large_vocabulary() -> None:
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(262_144, generator=gen) * 5
    b = a + torch.randn(262_144, generator=gen) * 1e-3
    value = kl_divergence(a.float(), b.float())
    assert 0 < value < 1e-4


def test_top1_agreement() -> None:
    assert top1_agree(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([-5.0, 0.1, 0.0]))
    assert not top1_agree(torch.tensor([0.0, 3.0, 1.0]), torch.tensor([0.0, 1.0, 3.0]))


def test_accuracy_looks_at_the_first_nonempty_line() -> None:
    assert first_line("\n  \n 4817.\nAnswer: 1234") == " 4817."
    assert is_correct(" 4817.\nQuestion", ["4817"])
    assert not is_correct(" 1234.\nThe code is 4817", ["4817"])
    assert is_correct(" Exeter college", ["Exeter College", "Exeter"])
    assert not is_correct("", ["x"])


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


def _record(system: str, request: str, **fields) -> RequestRecord:
    base = dict(prompt_tokens=100, computed_tokens=100, prefill_flops=1000.0, ttft_s=1.0, token_ids=[1, 2])
    base.update(fields)
    return RequestRecord(system, request, **base)  # type: ignore[arg-type]


def test_compare_against_the_reference() -> None:
    ref = _record("off", "r0", ttft_s=2.0, prefill_flops=1000.0, token_ids=[5, 6, 7])
    rec = _record("splice:none@0", "r0", ttft_s=0.5, prefill_flops=100.0, token_ids=[5, 6, 8])
    logits = torch.tensor([1.0, 2.0, 3.0])
    compare(rec, ref, logits, torch.tensor([0.0, 0.0, 3.0]))
    assert rec.kl > 0.0 and rec.top1 is True and rec.same_continuation is False
    # Each side's top probability minus its runner-up's, computed by hand.
    e = torch.tensor([1.0, 2.0, 3.0]).exp()
    assert rec.margin == pytest.approx(float((e[2] - e[1]) / e.sum()))
    assert rec.reference_margin == pytest.approx(float((e[2] - 1) / (e[2] + 2)))
    assert rec.matched_tokens == 2
    assert rec.ttft_speedup == 4.0 and rec.reference_flops == 1000.0


def test_summaries_count_failures_and_average_over_completed_requests() -> None:
    records = [
        _record("off", "w", warmup=True, ttft_s=100.0),
        _record("off", "r0", ttft_s=2.0, kl=0.0, top1=True, same_continuation=True, correct=True),
        _record("off", "r1", ttft_s=4.0, kl=0.0, top1=True, same_continuation=True, correct=False),
        _record(
            "splice:deviation@15",
            "r0",
            ttft_s=1.0,
            prefix_hit_tokens=10,
            segment_hit_tokens=80,
            computed_tokens=10,
            recomputed_tokens=12,
            prefill_flops=250.0,
            background_flops=500.0,
            reference_flops=1000.0,
            kl=0.2,
            top1=False,
            same_continuation=False,
            correct=True,
            kv_peak_bytes=2048,
        ),
        RequestRecord("splice:deviation@15", "r1", error="OutOfBlocksError: no memory"),
        RequestRecord("hash", "r0", error="RuntimeError: boom"),
        RequestRecord("hash", "r1", error="RuntimeError: boom"),
    ]
    off, splice, hash_ = summarize(records, ["off", "splice:deviation@15", "hash"])
    assert (off.requests, off.failed, off.ttft_p50_s, off.accuracy) == (2, 0, 3.0, 0.5)
    assert (splice.requests, splice.failed) == (2, 1)
    assert splice.computed_frac == pytest.approx(0.22)
    assert splice.prefix_hit_frac == pytest.approx(0.1) and splice.segment_hit_frac == pytest.approx(0.8)
    # The background work the request left counts in the total, not in the prefill's share.
    assert splice.flops_frac == pytest.approx(0.25) and splice.total_flops_frac == pytest.approx(0.75)
    assert splice.kl_mean == pytest.approx(0.2) and splice.top1_rate == 0.0 and splice.accuracy == 1.0
    assert (off.close_rate, splice.close_rate, hash_.close_rate) == (1.0, 0.0, None)
    assert splice.peak_kv_bytes == 2048
    assert (hash_.requests, hash_.failed, hash_.ttft_p50_s) == (2, 2, None)

    table = summary_table([off, splice, hash_], 16)
    lines = table.splitlines()
    assert "same 16" in lines[0]
    assert "1/2 (**1 failed**)" in lines[3]
    assert lines[4].startswith("| hash | 0/2 (**2 failed**) |") and lines[4].count("failed") == 18


def test_close_rate_counts_kls_at_most_the_threshold() -> None:
    assert KL_CLOSE == 0.05
    assert close_rate([0.0, 0.05, 0.0501, 1.0]) == 0.5
    assert close_rate([]) is None


def test_per_turn_rows() -> None:
    turn_one = {"turn": 1, "ttft_s": 0.5, "computed_tokens": 40, "prefix_hit_tokens": 50, "prompt_tokens": 90}
    records = [
        _record("off", "c0-0", turn=0, ttft_s=1.0, computed_tokens=50, prompt_tokens=50),
        _record("off", "c0-1", turn=1, ttft_s=2.0, computed_tokens=90, prompt_tokens=90),
        _record("radix", "c0-0", turn=0, ttft_s=1.0, computed_tokens=50, prompt_tokens=50),
        _record("radix", "c0-1", kl=0.02, top1=True, **turn_one),
        _record("radix", "c1-1", kl=0.2, top1=False, **turn_one),
    ]
    rows = per_turn(records, ["off", "radix"])
    assert [(r.turn, r.system) for r in rows] == [(0, "off"), (0, "radix"), (1, "off"), (1, "radix")]
    assert rows[3].computed_mean == 40 and rows[3].reused_mean == 50 and rows[3].ttft_p50_s == 0.5
    # KL over the records that have one: 0.02 and 0.2, standard error |0.2 - 0.02| / 2.
    assert rows[3].kl_mean == pytest.approx(0.11) and rows[3].kl_se == pytest.approx(0.09)
    assert rows[3].top1_rate == 0.5 and rows[2].kl_mean is None and rows[2].kl_se is None


def test_system_names_expand_without_pointless_duplicates() -> None:
    names = [s.name for s in parse_systems(["hash,radix", "splice"], [0, 5, 10, 100])]
    between = [p for p in POLICY_NAMES if p not in ("none", "full", "adaptive")]
    assert names == [
        "off",
        "hash",
        "radix",
        "splice:none@0",
        *(f"splice:{p}@{b}" for p in between for b in (5, 10)),
        "splice:adaptive",
        "splice:full@100",
    ]
    # The adaptive policy stops at a quality target: it takes no budget.
    adaptive = parse_systems(["splice:adaptive"])[1]
    assert adaptive.recompute_ratio is None and adaptive.name == "splice:adaptive"
    assert {"boundary", "deviation"} <= set(between)
    assert [s.name for s in parse_systems(["splice:deviation@15", "splice:deviation@15.0"])] == [
        "off",
        "splice:deviation@15",
    ]
    assert parse_systems(["splice:full"])[1].recompute_ratio == 1.0
    # By default the prefix caches and what the engine does: its repair policy at its budget.
    engine = EngineConfig()
    default = default_systems()
    assert [s.name for s in default] == ["off", "hash", "radix", f"splice:{engine.repair}@15"]
    assert default[-1].recompute_ratio == pytest.approx(engine.recompute_ratio)
    assert {s.engine_key for s in default} == {"off", "hash", "radix", "splice"}
    # The published baselines stay one name away.
    assert [s.name for s in parse_systems(["splice:none,splice:boundary", "splice:deviation"])] == [
        "off",
        "splice:none@0",
        "splice:boundary@15",
        "splice:deviation@15",
    ]
    sweep = parse_systems(["splice"], SWEEP_BUDGETS)
    assert len(sweep) == 1 + 3 + len(between) * 4
    # A fallback margin suffix: the same policy and budget, a system of its own.
    plain, gated = parse_systems(["splice:attention@15", "splice:attention@15+fallback0.03"])[1:]
    assert (gated.fallback_margin, gated.recompute_ratio, gated.name) == (
        0.03,
        0.15,
        "splice:attention@15+fallback0.03",
    )
    assert plain.fallback_margin is None and gated.cache_salt != plain.cache_salt
    assert name_parts("splice:attention@15+fallback0.03/plain") == ("attention", "15", "+fallback0.03/plain")
    assert name_parts("splice:adaptive") == ("adaptive", "", "") and name_parts("radix") == ("radix", "", "")
    bad_names = ("lru", "splice:nope", "splice:deviation@x", "splice:deviation@150", "splice:adaptive@0.02")
    bad_suffixes = (
        "radix+fallback0.1",
        "splice:attention@15+fallback2",
        "splice:attention@15+fallbackx",
        "splice:attention@15+gate1",
    )
    for bad in (
        *bad_names,
        *bad_suffixes,
        "splice:attention@15+shift0.5",
        "splice:attention@15+fallback0+fallback0.1",
    ):
        with pytest.raises(ValueError):
            parse_systems([bad])


def test_prompt_parts_mark_documents_as_segments_only_when_splicing() -> None:
    request = BenchRequest("r", ("Intro. ", Doc("d0", "alpha beta\n\n"), Doc("d1", "gamma\n\n"), "Question?"))
    off, splice = parse_systems(["splice:boundary@10"])
    assert prompt_parts(off, request) == ["Intro. ", "alpha beta\n\n", "gamma\n\n", "Question?"]
    assert prompt_parts(splice, request) == [
        "Intro. ",
        Segment("alpha beta\n\n"),
        Segment("gamma\n\n"),
        "Question?",
    ]
    encode = WordHashEncoder(320)
    ids = prompt_parts(splice, request, encode)
    assert ids[1] == Segment(encode("alpha beta")) and all(4 <= t < 320 for t in encode("alpha beta gamma"))
    assert prompt_parts(off, request, encode)[1] == encode("alpha beta")


def _result(records: list[RequestRecord], systems: list[str]) -> BenchResult:
    machine = MachineInfo("cpu", 2, 2, "2.x", "3.11", "linux", (1.0, 1.0, 1.0), (2.0, 2.0, 2.0), "abc")
    return BenchResult(
        workload="chat",
        description="test",
        corpus="synthetic",
        spec={"requests": 1},
        systems=systems,
        command="kvsplice bench chat",
        machine=machine,
        model=None,
        kv_pools_gib={"off": 0.1},
        continuation_tokens=4,
        records=records,
        summaries=summarize(records, systems),
        turns=per_turn(records, systems),
        notes=["a note"],
    )


def test_report_shows_failures_and_turns_and_round_trips_through_json() -> None:
    records = [
        _record("off", "c0-0", turn=0),
        _record("off", "c0-1", turn=1),
        _record("radix", "c0-0", turn=0),
        RequestRecord("radix", "c0-1", turn=1, error="RuntimeError: boom"),
    ]
    result = _result(records, ["off", "radix"])
    text = markdown(result, ["frontier.png"])
    assert "### Per turn" in text and "| 1 | 100 | 1,000 | failed |" in text
    assert "- `radix`: 1× RuntimeError: boom" in text
    assert "a note" in text and "![frontier](frontier.png)" in text
    assert "load average 1.00 / 1.00 / 1.00 at the start" in text
    again = BenchResult.from_json(result.to_json())
    assert again == result


def test_the_report_opens_with_the_headline_table_then_the_details() -> None:
    records = [
        _record("off", "r0", ttft_s=2.0, kl=0.0, top1=True, same_continuation=True, reference_flops=1000.0),
        _record(
            "splice:none@0",
            "r0",
            ttft_s=0.5,
            ttft_speedup=4.0,
            prefix_hit_tokens=10,
            segment_hit_tokens=70,
            discovered_hit_tokens=5,
            computed_tokens=15,
            recomputed_tokens=5,
            prefill_flops=200.0,
            background_flops=100.0,
            reference_flops=1000.0,
            kl=0.02,
            top1=True,
            same_continuation=False,
        ),
        RequestRecord("radix", "r0", error="RuntimeError: boom"),
    ]
    text = markdown(_result(records, ["off", "splice:none@0", "radix"]))
    tables = [line for line in text.splitlines() if line.startswith("| system |")]
    head = tables[0]
    assert head == "| system | " + " | ".join(HEADLINE_COLUMNS) + " |"
    assert [c.strip() for c in head.strip("|").split("|")] == [
        "system",
        "TTFT p50 (ms)",
        "speedup",
        "reused",
        "computed",
        "total compute",
        "KL",
        "first token",
        "same continuation",
    ]
    # reused: prefix + segment + found; computed counts the recomputed; total compute the background.
    assert "| splice:none@0 | 500 | 4.00× | 85.0% | 20.0% | 30.0% | 0.0200 | 100% | 0% |" in text
    assert "| radix (**1 of 1 failed**) |" + " failed |" * 8 in text
    # The headline and its legend come first; every column follows under Details.
    assert text.index(head) < text.index("total compute:") < text.index("## Details") < text.index(tables[1])
    assert tables[1].startswith("| system | done | TTFT p50 ms |") and "| splice:none@0 | 1/1 |" in text
    assert text.index("## Failures") < text.index("## Details") < text.index("### Per turn")


def test_summary_rerenders_runs_and_draws_reuse_by_workload(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvsplice.bench import summary

    records = [_record("off", "c0-0", turn=0), _record("radix", "c0-0", turn=0, prefix_hit_tokens=60)]
    run = tmp_path / "chat"
    run.mkdir()
    _result(records, ["off", "radix"]).write_json(run / "results.json")
    summary.main([str(tmp_path)])
    assert "| chat | radix | 1,000 | – | 60% (60% + 0%) |" in capsys.readouterr().out
    for name in ("report.md", "frontier.png", "reuse.png", "turns.png"):
        assert (run / name).exists()
    assert (tmp_path / "reuse_by_workload.png").exists()


def test_kv_pools_keep_the_prefix_cache_engines_whole_and_cut_the_shared_one() -> None:
    from kvsplice.bench.harness import split_pools

    need = {"off": 10, "hash": 100, "radix": 100, "splice": 1000}
    floor = {"off": 10, "hash": 10, "radix": 10, "splice": 300}
    assert split_pools(need, floor, 2000) == need
    assert split_pools(need, floor, 700) == {"off": 10, "hash": 100, "radix": 100, "splice": 490}
    tight = split_pools(need, floor, 400)
    assert tight["off"] == 10 and 10 <= tight["hash"] < 100 and 300 <= tight["splice"] < 1000
    assert sum(tight.values()) <= 400
    assert split_pools({"off": 5, "radix": 50}, {"off": 5, "radix": 5}, 30) == {"off": 5, "radix": 25}
