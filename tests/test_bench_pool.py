"""Pooling one system's fidelity over runs of other seeds: the pooled figures against plain counts over
the concatenated requests, and the runs it must refuse. No model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvsplice.bench import pool
from kvsplice.bench.metrics import RequestRecord, per_turn, summarize
from kvsplice.bench.results import BenchResult, MachineInfo, ModelInfo
from kvsplice.bench.stats import paired_difference, wilson

SYSTEM = "splice:lead@15"

# Per request: (system correct, full prefill correct, system's KL, same first token, full prefill's margin).
Case = tuple[bool, bool, float, bool, float]


def _result(
    cases: list[Case], seed: int, commit: str = "abc", doc_words: int = 290, model: str = "g"
) -> BenchResult:
    records = [RequestRecord("off", "warm", warmup=True, setting="8 docs", correct=True)]
    for i, (ok, ref_ok, kl, top1, margin) in enumerate(cases):
        rid = f"recall-8-{i}"
        records.append(
            RequestRecord(
                "off", rid, setting="8 docs", kl=0.0, top1=True, reference_margin=margin, correct=ref_ok
            )
        )
        records.append(
            RequestRecord(
                SYSTEM, rid, setting="8 docs", kl=kl, top1=top1, reference_margin=margin, correct=ok
            )
        )
    # A request the system failed on pairs with nothing.
    records.append(RequestRecord("off", "failed", setting="8 docs", kl=0.0, top1=True, correct=True))
    records.append(RequestRecord(SYSTEM, "failed", setting="8 docs", error="out of memory"))
    systems = ["off", SYSTEM]
    machine = MachineInfo("cpu", 2, 1, "2.x", "3.11", "linux", None, None, commit)
    info = ModelInfo(model, "Gemma3ForCausalLM", 268_000_000, 18, "float32", "float32", 16, 4, True)
    spec = {"requests": len(cases), "seed": seed, "doc_counts": (8,), "doc_words": doc_words}
    return BenchResult(
        "recall", "test", "synthetic", spec, systems, f"run {seed}", machine, info, {}, 5,
        records, summarize(records, systems), per_turn(records, systems),
    )  # fmt: skip


A: list[Case] = [
    (True, True, 0.01, True, 0.5),
    (False, True, 0.20, False, 0.01),
    (True, False, 0.03, False, 0.05),
    (True, True, 0.00, True, 0.3),
]
B: list[Case] = [
    (False, True, 0.07, False, 0.15),
    (True, True, 0.04, True, 0.25),
    (False, False, 0.06, True, 0.0),
]


def test_pooled_figures_are_those_of_the_concatenated_requests() -> None:
    # The second run was recorded under another display name of the same weights.
    (row,) = pool.pool([_result(A, 1, "c1"), _result(B, 2, "c2", model="Gemma 3 270M")], SYSTEM)
    both = A + B
    assert row.requests == 7 and row.seeds == (1, 2) and row.commits == ("c1", "c2")
    assert row.accuracy == pytest.approx(4 / 7) and row.reference_accuracy == pytest.approx(5 / 7)
    assert row.accuracy_delta == paired_difference([(c[0], c[1]) for c in both])
    assert row.accuracy_delta.estimate == pytest.approx(-1 / 7)
    assert row.kl_mean == pytest.approx(sum(c[2] for c in both) / 7)
    # KLs of 0.01, 0.03, 0.00, 0.04 are within 0.05.
    assert row.close == wilson(4, 7)
    assert row.top1 == wilson(4, 7)
    # Margins of at least 0.02: 0.5, 0.05, 0.3, 0.15, 0.25, whose first tokens agree on 3; at least
    # 0.1: 0.5, 0.3, 0.15, 0.25 (3 agree); at least 0.2: 0.5, 0.3, 0.25 (all agree).
    assert [(x.margin, x.requests, x.top1) for x in row.led] == [
        (0.02, 5, wilson(3, 5)),
        (0.1, 4, wilson(3, 4)),
        (0.2, 3, wilson(3, 3)),
    ]
    text = pool.table([row], SYSTEM)
    assert "| 7 (1, 2) | 57.1% (71.4%) | -14.3 [" in text


def test_runs_of_one_seed_are_refused() -> None:
    with pytest.raises(ValueError, match="seed 1 measured the same requests"):
        pool.pool([_result(A, 1), _result(B, 1)], SYSTEM)


def test_runs_of_another_evaluation_are_refused() -> None:
    with pytest.raises(ValueError, match="do not pool"):
        pool.pool([_result(A, 1), _result(B, 2, doc_words=120)], SYSTEM)


def test_a_run_without_the_system_is_refused() -> None:
    with pytest.raises(ValueError, match="no system 'splice:query@15'"):
        pool.pool([_result(A, 1)], "splice:query@15")


def test_the_command_reads_run_directories(tmp_path: Path, capsys) -> None:
    dirs = []
    for seed, cases in ((1, A), (2, B)):
        d = tmp_path / f"s{seed}"
        d.mkdir()
        _result(cases, seed).write_json(d / "results.json")
        dirs.append(str(d))
    pool.main([*dirs, "--system", SYSTEM])
    out = capsys.readouterr().out
    assert "`splice:lead@15` against the full prefill" in out and "| 7 (1, 2) |" in out


def test_the_command_says_why_runs_do_not_pool(tmp_path: Path, capsys) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        _result(A, 1).write_json(tmp_path / name / "results.json")
    with pytest.raises(SystemExit) as exit_:
        pool.main([str(tmp_path / "a"), str(tmp_path / "b"), "--system", SYSTEM])
    assert exit_.value.code == 2
    assert "seed 1 measured the same requests" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pool.main([str(tmp_path / "missing"), "--system", SYSTEM])
    assert "No such file" in capsys.readouterr().err


def _renamed(result: BenchResult, name: str) -> BenchResult:
    """The same run with the pooled system under another name."""
    records = [replace(r, system=name) if r.system == SYSTEM else r for r in result.records]
    systems = [name if s == SYSTEM else s for s in result.systems]
    return replace(result, systems=systems, records=records, summaries=summarize(records, systems))


def test_a_system_renamed_between_runs_pools_by_its_name_in_each(tmp_path: Path, capsys) -> None:
    """Once the shift became Gemma 3's default, `splice:lead@15+shift0.5` of older runs is the newer
    runs' `splice:lead@15`: named per run, they pool as if the name had never changed."""
    other = "splice:lead@15+shift0.5"
    same = pool.pool([_result(A, 1), _result(B, 2)], SYSTEM)
    assert pool.pool([_result(A, 1), _renamed(_result(B, 2), other)], [SYSTEM, other]) == same
    with pytest.raises(ValueError, match="no system"):
        pool.pool([_result(A, 1), _renamed(_result(B, 2), other)], SYSTEM)
    with pytest.raises(ValueError, match="one per run"):
        pool.pool([_result(A, 1), _result(B, 2)], [SYSTEM])
    for seed, result in ((1, _result(A, 1)), (2, _renamed(_result(B, 2), other))):
        (tmp_path / f"s{seed}").mkdir()
        result.write_json(tmp_path / f"s{seed}" / "results.json")
    pool.main([str(tmp_path / "s1"), f"{tmp_path / 's2'}={other}", "--system", SYSTEM])
    assert "| 7 (1, 2) |" in capsys.readouterr().out
