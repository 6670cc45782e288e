"""Confidence intervals against published values, the answer-at-start judge, and the breakdown by
setting and answer position in the report. No model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvsplice.bench.base import BenchRequest, Doc
from kvsplice.bench.metrics import ALL, RequestRecord, by_group, compare, is_correct, per_turn, summarize
from kvsplice.bench.plots import write_plots
from kvsplice.bench.report import breakdown_tables, markdown
from kvsplice.bench.results import BenchResult, MachineInfo
from kvsplice.bench.stats import paired_difference, requests_to_show, wilson


@pytest.mark.parametrize(
    ("successes", "n", "low", "high"),
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Stat Med 17:857.
    [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)],
)
def test_wilson_interval_matches_published_values(successes: int, n: int, low: float, high: float) -> None:
    interval = wilson(successes, n)
    assert interval is not None
    assert interval.estimate == successes / n
    assert (interval.low, interval.high) == (pytest.approx(low, abs=5e-5), pytest.approx(high, abs=5e-5))


def test_wilson_edges() -> None:
    assert wilson(0, 0) is None
    full = wilson(12, 12)
    assert full is not None and full.high == 1.0 and 0.7 < full.low < 1.0
    with pytest.raises(ValueError):
        wilson(3, 2)


def _pairs(both: int, first_only: int, second_only: int, neither: int) -> list[tuple[bool, bool]]:
    return (
        [(True, True)] * both
        + [(True, False)] * first_only
        + [(False, True)] * second_only
        + [(False, False)] * neither
    )


def test_paired_difference_matches_a_published_value() -> None:
    # Complete response before and after consolidation therapy (Cavo et al. 2012), Newcombe's
    # square-and-add interval as given by Fagerland, Lydersen and Laake (Statistical Analysis of
    # Contingency Tables, ch. 8): -0.0621 (-0.1186 to -0.0046).
    interval = paired_difference(_pairs(59, 6, 16, 80))
    assert interval is not None
    assert interval.estimate == pytest.approx(-0.0621, abs=5e-5)
    assert (interval.low, interval.high) == (
        pytest.approx(-0.1186, abs=5e-5),
        pytest.approx(-0.0046, abs=5e-5),
    )


def test_paired_difference_properties() -> None:
    assert paired_difference([]) is None
    forward = paired_difference(_pairs(10, 2, 7, 5))
    backward = paired_difference([(y, x) for x, y in _pairs(10, 2, 7, 5)])
    assert forward is not None and backward is not None
    assert backward.estimate == pytest.approx(-forward.estimate)
    assert (backward.low, backward.high) == (pytest.approx(-forward.high), pytest.approx(-forward.low))
    assert forward.low < forward.estimate < forward.high < 0.1
    same = paired_difference(_pairs(8, 0, 0, 4))
    assert same is not None and same.estimate == 0 and same.low < 0 < same.high
    gain = paired_difference(_pairs(0, 20, 0, 0))
    assert gain is not None and gain.estimate == 1 and gain.high == 1 and gain.low > 0.5


def test_requests_to_show_a_floor() -> None:
    """The smallest number of requests, at the same outcome proportions, whose interval clears the
    floor: checked against a scan over every n, and None where the estimate itself is below it."""
    pairs = _pairs(60, 5, 5, 30)  # estimate 0: the interval narrows onto it

    def low(n: int) -> float:
        # At multiples of 20 requests the proportions are whole counts.
        interval = paired_difference(_pairs(*(c * n // 100 for c in (60, 5, 5, 30))))
        assert interval is not None
        return interval.low

    needed = requests_to_show(pairs, -0.02)
    assert needed is not None and needed > 100
    scan = next(n for n in range(100, 10_000, 20) if low(n) >= -0.02)
    assert scan - 20 < needed <= scan
    assert low(100) >= -0.10 and requests_to_show(pairs, -0.10) <= 100
    assert requests_to_show(_pairs(60, 2, 5, 33), -0.02) is None  # -3 points: never above -2
    assert requests_to_show([], -0.02) is None


def test_answer_at_start_judge() -> None:
    assert is_correct("4721.\nQuestion: x", ["4721"], at_start=True)
    assert is_correct(" marta.", ["Marta"], at_start=True)
    assert is_correct(" Lisbon", ["Lisbon"], at_start=True)
    assert not is_correct(" 47210", ["4721"], at_start=True)
    assert not is_correct(" Brenda", ["Bren"], at_start=True)
    assert not is_correct(" the code is 4721", ["4721"], at_start=True)
    assert not is_correct("\n4721", ["4721"], at_start=True)
    assert not is_correct("", ["4721"], at_start=True)
    # The default judge looks anywhere in the first line.
    assert is_correct(" the code is 4721", ["4721"])


def test_records_carry_the_request_labels() -> None:
    request = BenchRequest(
        "recall-8-3",
        ("Intro ", Doc("d8-0", "text"), "Question"),
        answers=("Oslo",),
        setting="8 docs",
        answer_position="middle",
        answer_at_start=True,
    )
    record = RequestRecord.for_request("off", request)
    assert (record.system, record.request_id, record.warmup) == ("off", "recall-8-3", False)
    assert (record.setting, record.answer_position) == ("8 docs", "middle")


def _record(system: str, request: str, setting: str, position: str, correct: bool, **fields) -> RequestRecord:
    base = dict(
        prompt_tokens=100,
        computed_tokens=100,
        prefill_flops=1e9,
        ttft_s=1.0,
        token_ids=[1, 2],
        kl=0.0,
        top1=True,
    )
    base.update(fields)
    return RequestRecord(system, request, setting=setting, answer_position=position, correct=correct, **base)  # type: ignore[arg-type]


def _records() -> list[RequestRecord]:
    """Two settings; the splice system loses the middle answers of "4 docs" and fails once."""
    out = [RequestRecord("splice:none@0", "w", warmup=True, setting="4 docs")]
    for setting in ("4 docs", "8 docs"):
        for i, position in enumerate(["first", "middle", "last"] * 2):
            rid = f"{setting}-{i}"
            out.append(_record("off", rid, setting, position, True, matched_tokens=2))
            lost = setting == "4 docs" and position == "middle"
            if setting == "8 docs" and i == 5:
                out.append(
                    RequestRecord(
                        "splice:none@0", rid, setting=setting, answer_position=position, error="boom"
                    )
                )
                continue
            out.append(
                _record(
                    "splice:none@0", rid, setting, position, not lost, kl=0.5 if lost else 0.1, top1=not lost
                )
            )
    return out


def test_groups_by_setting_and_position_with_paired_differences() -> None:
    rows = by_group(_records(), ["off", "splice:none@0"])
    keys = [(r.setting, r.answer_position, r.system) for r in rows]
    # Per setting in the run's order, then over all settings; all positions first, then each one.
    assert keys[:8] == [
        (setting, position, system)
        for setting in ["4 docs"]
        for position in [ALL, "first", "middle", "last"]
        for system in ["off", "splice:none@0"]
    ]
    assert {k[0] for k in keys} == {"4 docs", "8 docs", ALL} and len(rows) == 3 * 4 * 2
    by = {(r.setting, r.answer_position, r.system): r for r in rows}
    middle = by[("4 docs", "middle", "splice:none@0")]
    assert middle.requests == 2 and middle.accuracy is not None and middle.accuracy.estimate == 0
    assert middle.accuracy_diff is not None and middle.accuracy_diff.estimate == -1
    assert middle.kl_mean == pytest.approx(0.5) and middle.top1_rate == 0
    four = by[("4 docs", ALL, "splice:none@0")]
    assert four.accuracy is not None and four.accuracy.estimate == pytest.approx(4 / 6)
    # Two losses in six requests: the interval cannot tell them from none.
    diff = four.accuracy_diff
    assert diff is not None and diff.estimate == pytest.approx(-1 / 3) and diff.low < -0.5 and diff.high > 0
    assert four.kl_mean == pytest.approx((4 * 0.1 + 2 * 0.5) / 6)
    # Every KL of the splice system is above 0.05; the reference's are 0.
    assert four.close_rate == 0 and by[("4 docs", ALL, "off")].close_rate == 1
    # A failed request counts as failed, never as wrong, and is not paired.
    eight = by[("8 docs", ALL, "splice:none@0")]
    assert (eight.requests, eight.failed) == (6, 1) and eight.accuracy is not None
    assert (
        eight.accuracy.estimate == 1 and eight.accuracy_diff is not None and eight.accuracy_diff.estimate == 0
    )
    assert by[(ALL, ALL, "off")].requests == 12 and by[(ALL, ALL, "off")].matched_mean == 2
    # Records without a setting (every other workload) have no breakdown.
    plain = [RequestRecord("off", "r0", correct=True)]
    assert by_group(plain, ["off"]) == []


def _result(records: list[RequestRecord], systems: list[str]) -> BenchResult:
    machine = MachineInfo("cpu", 2, 1, "2.x", "3.11", "linux", (1.0, 1.0, 1.0), (2.0, 2.0, 2.0), "abc")
    return BenchResult(
        workload="recall",
        description="test",
        corpus="synthetic",
        spec={"requests": 6, "doc_counts": (4, 8)},
        systems=systems,
        command="kvsplice bench recall",
        machine=machine,
        model=None,
        kv_pools_gib={"off": 0.1},
        continuation_tokens=2,
        records=records,
        summaries=summarize(records, systems),
        turns=per_turn(records, systems) if any(r.turn for r in records) else [],
    )


def test_top1_where_the_full_prefill_is_sure() -> None:
    # Full prefills that give the first token 0.5 against 0.4 (torn) and 0.7 against 0.2 (sure).
    torn, sure = torch.tensor([0.5, 0.4, 0.1]).log(), torch.tensor([0.7, 0.2, 0.1]).log()
    flipped = torch.tensor([0.4, 0.5, 0.1]).log()
    records = []
    for i, (ref_logits, logits) in enumerate([(torn, flipped), (sure, sure), (sure, flipped)]):
        reference = _record("off", f"r{i}", "8 docs", "first", True)
        record = _record("splice:attention@15", f"r{i}", "8 docs", "first", True)
        compare(record, reference, logits, ref_logits)
        records += [reference, record]
    assert [r.reference_margin for r in records[1::2]] == pytest.approx([0.1, 0.5, 0.5])
    row = {r.system: r for r in by_group(records, ["off", "splice:attention@15"])}["splice:attention@15"]
    # Two flips in three; of the two sure requests one flipped.
    assert row.top1_rate == pytest.approx(1 / 3) and (row.top1_sure_rate, row.sure) == (0.5, 2)
    assert "| 50% (2) |" in breakdown_tables(by_group(records, ["off", "splice:attention@15"]), "off")


def test_report_shows_the_breakdown_and_round_trips(tmp_path: Path) -> None:
    systems = ["off", "splice:none@0"]
    result = _result(_records(), systems)
    text = markdown(result)
    assert "## By setting and answer position" in text
    assert "### 4 docs" in text and "### 8 docs" in text and "### All settings" in text
    assert (
        "| middle | splice:none@0 | 2/2 | 0% [0–66] | -100 [-100, -7] | 0.5000 | 0% | 0% | – (0) | – |"
        in text
    )
    assert "| all | off | 6/6 | 100% [61–100] | – |" in text
    assert "| all | splice:none@0 | 5/6 (1 failed) |" not in text and "| all | splice:none@0 | 5/6 |" in text
    # The analyses of recorded runs (bench/analyses/) are not part of the report.
    assert "targets would cost" not in text and "gated on the system's own confidence" not in text
    again = BenchResult.from_json(result.to_json())
    assert again == result and again.spec["doc_counts"] == (4, 8)
    assert "positions.png" in write_plots(result, tmp_path) and (tmp_path / "positions.png").stat().st_size
    other = _result([RequestRecord("off", "r0", correct=True)], ["off"])
    assert "By setting" not in markdown(other) and "positions.png" not in write_plots(other, tmp_path)
