"""The cross-run fidelity frontier: which points it draws, and that it refuses runs of one model that
measured different requests. No model."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvsplice.bench import frontier
from kvsplice.bench.metrics import RequestRecord, per_turn, summarize
from kvsplice.bench.results import BenchResult, MachineInfo, ModelInfo


def _run(tmp_path: Path, name: str, model: str, kls: dict[str, list[float]], requests: int = 2) -> Path:
    records = []
    for system, values in kls.items():
        for i, kl in enumerate(values):
            flops = 1000.0 if system == "off" else 100.0 + 1000 * kl
            records.append(
                RequestRecord(
                    system,
                    f"r{i}",
                    prompt_tokens=100,
                    computed_tokens=100,
                    ttft_s=1.0,
                    kl=kl,
                    top1=kl < 0.5,
                    prefill_flops=flops,
                    reference_flops=1000.0,
                    correct=True,
                )
            )
    systems = list(kls)
    machine = MachineInfo("cpu", 2, 1, "2.x", "3.11", "linux", None, None, "abc")
    info = ModelInfo(model, "X", 1, 1, "float32", "float32", 16, 4, True)
    result = BenchResult(
        "recall", "test", "synthetic", {"requests": requests, "doc_counts": (8,)}, systems, "cmd",
        machine, info, {}, 2, records, summarize(records, systems), per_turn(records, systems),
    )  # fmt: skip
    out = tmp_path / name
    out.mkdir()
    result.write_json(out / "results.json")
    return out


def test_frontier_draws_each_splice_system_once_per_model(tmp_path: Path, capsys) -> None:
    a = _run(
        tmp_path, "a", "gemma", {"off": [0, 0], "splice:none@0": [0.2, 0.4], "splice:query@15": [0.01, 0.1]}
    )
    b = _run(
        tmp_path, "b", "gemma", {"off": [0, 0], "splice:query@15": [0.3, 0.3], "splice:query@30": [0.0, 0.02]}
    )
    c = _run(tmp_path, "c", "smollm2", {"off": [0, 0], "splice:none@0": [0.5, 0.5]}, requests=5)
    out = tmp_path / "frontier.png"
    frontier.main([str(a), str(b), str(c), "--out", str(out)])
    assert out.stat().st_size > 0
    text = capsys.readouterr().out
    # query@15 comes from the first run that has it; the reference is not a point.
    assert "| query@15 | 15.5% | 0.0550 | 50% | 100% | 100% | a |" in text
    assert "| query@30 | 11.0% | 0.0100 | 100% | 100% | 100% | b |" in text
    assert "| none@0 | 60.0% | 0.5000 | 0% | 0% | 100% | c |" in text
    assert "| off |" not in text and text.index("**gemma**") < text.index("**smollm2**")


def test_frontier_refuses_runs_of_one_model_on_different_requests(tmp_path: Path) -> None:
    a = _run(tmp_path, "a", "gemma", {"off": [0, 0], "splice:none@0": [0.2, 0.4]})
    b = _run(tmp_path, "b", "gemma", {"off": [0, 0], "splice:none@0": [0.2, 0.4]}, requests=3)
    runs = [(d, BenchResult.from_json((d / "results.json").read_text())) for d in (a, b)]
    with pytest.raises(ValueError, match="other requests"):
        frontier.collect(runs)
    assert frontier.collect([runs[0], (b, replace(runs[0][1]))])["gemma"][0].run == a


def test_frontier_names_a_run_by_its_path_below_the_runs_common_directory(tmp_path: Path, capsys) -> None:
    (tmp_path / "probe").mkdir()
    a = _run(tmp_path / "probe", "layer8", "gemma", {"off": [0, 0], "splice:lead@15": [0.01, 0.1]})
    b = _run(tmp_path, "policies", "gemma", {"off": [0, 0], "splice:none@0": [0.2, 0.4]})
    frontier.main([str(a), str(b), "--out", str(tmp_path / "frontier.png")])
    text = capsys.readouterr().out
    assert "| probe/layer8 |" in text and "| policies |" in text


def test_a_shifted_policy_is_a_line_of_its_own(tmp_path: Path, capsys) -> None:
    """`lead@15+shift0.5` is not a budget of `lead`: its point is labelled by its budget, on a line of
    its own, and listed after `lead`'s."""
    kls = {"off": [0, 0], "splice:lead@15": [0.02, 0.04], "splice:lead@20": [0.01, 0.03]}
    a = _run(tmp_path, "a", "gemma", {**kls, "splice:lead@15+shift0.5": [0.01, 0.02]})
    frontier.main([str(a), "--out", str(tmp_path / "frontier.png")])
    rows = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[1:] == ["| lead@15", "| lead@20", "| lead@15+shift0.5"]
    shifted, plain = frontier._family("splice:lead@15+shift0.5"), frontier._family("splice:lead@20")
    assert (shifted, plain) == ("lead+shift0.5", "lead")
