"""The confidence-gated fallback replay (bench/gate.py): hand-computed cases, and the least gate against
a brute-force search over every threshold. No model."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsplice.bench import gate
from kvsplice.bench.headroom import Targets, paired
from kvsplice.bench.metrics import RequestRecord, per_turn, summarize
from kvsplice.bench.results import BenchResult, MachineInfo, ModelInfo

TARGETS = Targets(kl=0.05, close_share=0.75, top1=0.8, accuracy_drop=0.1)

# Per request: (own margin, KL, same first token, correct, full prefill correct, own FLOPs, full FLOPs).
Case = tuple[float, float, bool, bool, bool, float, float]

CASES: list[Case] = [
    (0.01, 0.20, False, False, True, 10.0, 100.0),
    (0.20, 0.01, True, True, True, 10.0, 100.0),
    (0.04, 0.03, False, True, False, 20.0, 100.0),
    (0.50, 0.00, True, True, True, 10.0, 100.0),
]


def _records(cases: list[Case], margins: bool = True) -> list[RequestRecord]:
    records = [RequestRecord("off", "warm", warmup=True, prefill_flops=1.0)]
    for i, (margin, kl, top1, ok, ref_ok, flops, ref_flops) in enumerate(cases):
        records.append(
            RequestRecord("off", f"r{i}", kl=0.0, top1=True, correct=ref_ok, prefill_flops=ref_flops)
        )
        records.append(
            RequestRecord(
                "splice", f"r{i}", kl=kl, top1=top1, correct=ok, prefill_flops=flops,
                margin=margin if margins else None,
            )
        )  # fmt: skip
    return records


def _pairs(records: list[RequestRecord]) -> list[gate.Pair]:
    (pairs,) = paired(records, "off").values()
    return pairs


def test_the_gate_replaces_gated_requests_with_the_full_prefill_and_pays_for_both() -> None:
    pairs = _pairs(_records(CASES))
    own = gate.replay(pairs, 0.0, TARGETS)
    assert (own.gated, own.close_share, own.top1, own.accuracy_diff) == (0, 0.75, 0.5, 0.0)
    assert math.isclose(own.flops_share, 50 / 400)
    # Below 0.05: r0 and r2. Both flips become the full prefill's token; r0 gains its answer, r2 loses one.
    p = gate.replay(pairs, 0.05, TARGETS)
    assert (p.gated, p.close_share, p.top1, p.accuracy_diff) == (2, 1.0, 1.0, 0.0)
    assert math.isclose(p.flops_share, (50 + 200) / 400)
    # The margin must be below the threshold: at exactly 0.04, r2 is not gated.
    assert gate.replay(pairs, 0.04, TARGETS).gated == 1


def test_the_least_gate_for_the_first_token_stops_at_the_last_flip() -> None:
    pairs = _pairs(_records(CASES))
    first = gate.least(pairs, TARGETS, top1_only=True)
    # 80% of 4 needs both flips fixed: r0 (0.01) and r2 (0.04), not r1 (0.20).
    assert first is not None and first.gated == 2 and 0.04 < first.threshold <= 0.2
    met = gate.replay(pairs, 0.0, Targets(kl=0.05, close_share=0.75, top1=0.5, accuracy_drop=0.1))
    assert met.meets(Targets(kl=0.05, close_share=0.75, top1=0.5, accuracy_drop=0.1))


@st.composite
def runs(draw: st.DrawFn) -> list[Case]:
    n = draw(st.integers(1, 7))
    return [
        (
            draw(st.sampled_from([0.0, 0.01, 0.05, 0.3, 0.9])),
            draw(st.sampled_from([0.0, 0.01, 0.2])),
            draw(st.booleans()),
            draw(st.booleans()),
            draw(st.booleans()),
            float(draw(st.integers(5, 20))),
            float(draw(st.integers(50, 100))),
        )
        for _ in range(n)
    ]


def _brute(cases: list[Case], top1_only: bool) -> float | None:
    """The least FLOPs share over every threshold that gates the requests with margin below it, each
    scored by counting directly."""
    best = None
    for threshold in [0.0, *(c[0] + 1e-6 for c in cases), math.inf]:
        gated = [c[0] < threshold for c in cases]
        n = len(cases)
        close = sum(g or c[1] <= TARGETS.kl for g, c in zip(gated, cases, strict=True))
        agree = sum(g or c[2] for g, c in zip(gated, cases, strict=True))
        correct = sum(c[4] if g else c[3] for g, c in zip(gated, cases, strict=True))
        meets = agree >= TARGETS.top1 * n - 1e-9 and (
            top1_only
            or (
                close >= TARGETS.close_share * n - 1e-9
                and correct >= sum(c[4] for c in cases) - 0.1 * n - 1e-9
            )
        )
        if meets:
            spent = sum(c[5] + (c[6] if g else 0.0) for g, c in zip(gated, cases, strict=True))
            share = spent / sum(c[6] for c in cases)
            best = share if best is None else min(best, share)
    return best


@settings(max_examples=300, deadline=None)
@given(runs(), st.booleans())
def test_the_least_gate_is_the_cheapest_threshold(cases: list[Case], top1_only: bool) -> None:
    pairs = _pairs(_records(cases))
    found = gate.least(pairs, TARGETS, top1_only)
    expected = _brute(cases, top1_only)
    # Gating every request meets every target, so some threshold always does.
    assert found is not None and expected is not None
    assert math.isclose(found.flops_share, expected)
    assert found.meets(TARGETS, top1_only)
    # The system as it ran is the gate at 0, and a higher threshold never agrees on fewer first tokens.
    assert gate.replay(pairs, 0.0, TARGETS).top1 == sum(c[2] for c in cases) / len(cases)
    assert gate.replay(pairs, 0.1, TARGETS).top1 <= gate.replay(pairs, 0.5, TARGETS).top1


def _write(tmp_path: Path, name: str, records: list[RequestRecord]) -> Path:
    systems = ["off", "splice"]
    machine = MachineInfo("cpu", 2, 1, "2.x", "3.11", "linux", None, None, "abc")
    info = ModelInfo("g", "Gemma3ForCausalLM", 268_000_000, 18, "float32", "float32", 16, 4, True)
    result = BenchResult(
        "recall", "test", "synthetic", {"requests": 4}, systems, "run", machine, info, {}, 5,
        records, summarize(records, systems), per_turn(records, systems),
    )  # fmt: skip
    (tmp_path / name).mkdir()
    result.write_json(tmp_path / name / "results.json")
    return tmp_path / name


def test_the_command_finds_and_replays_gates(tmp_path: Path, capsys) -> None:
    records = _records(CASES)
    # A system that ran with a fallback margin and used it is not replayed on top of its own gate.
    gated = [
        replace(r, system="splice+fallback0.1", fell_back=(r.margin or 0) < 0.1)
        for r in records
        if r.system == "splice"
    ]
    a = _write(tmp_path, "a", records + gated)
    old = _write(tmp_path, "old", _records(CASES, margins=False))
    gate.main([str(a), str(old)])
    out = capsys.readouterr().out
    # Every target (95%, 98%): all four must be right; the least threshold gates r0 and r2 only if
    # that suffices, and it does (r1 and r3 are within KL 0.05 and agree).
    assert "| splice | 4 | 12.5% | 50% | 75% | 0.040: 2 (50%), 62.5% | 0.040: 2 (50%), 62.5% |" in out
    assert "no system with its margins recorded" in out and "splice+fallback0.1" not in out
    gate.main([str(a), str(a), "--pool", "--threshold", "0.05"])
    assert "| splice | 0.05 | 8 | 4 (50%) | 100% | 100% | +0.0 | 62.5% |" in capsys.readouterr().out
