"""`kvsplice bench router`: its arguments and report without a server; one slow smoke run on real
deployments (the default model, vllm-router, redis-server)."""

from __future__ import annotations

import pytest

from kvsplice.bench import traffic
from kvsplice.bench.results import MachineInfo
from kvsplice.bench.traffic import TrafficConfig
from kvsplice.bench.traffic_report import Calibration, Cell, Compute, MixInfo, Sent, TrafficResult
from kvsplice.bench.traffic_router import BASELINE, parse_layouts, report, run_router_traffic
from kvsplice.cli import main


def test_layouts_always_include_the_baseline_and_bad_arguments_are_refused() -> None:
    assert parse_layouts(["2x1-rr"]) == (BASELINE, "2x1-rr")
    assert parse_layouts(["2x1-cache", "1x1", "2x1-cache"]) == ("1x1", "2x1-cache")
    with pytest.raises(ValueError, match="unknown deployment"):
        parse_layouts(["3x1"])
    for bad in (
        ["router", "--deployments", "3x1"],
        ["router", "--num-threads", "2"],  # the layouts set threads
        ["traffic", "--deployments", "2x1-rr"],
    ):
        assert main(["bench", *bad]) == 2


def _cell(system: str, ttfts: list[float], store_hit_tokens: float) -> Cell:
    sent = [Sent(i, float(i), 0.0, t, t + 1, 100, 4, [1, 2, 3, 4]) for i, t in enumerate(ttfts)]
    compute = Compute(1000, 4e9, 0, 0, 1000, 0, 0, 600, 0, 400, 0, store_hit_tokens=store_hit_tokens)
    return Cell(system, "popular", 0.5, 1.0, 10.0, sent, compute)


def test_report_gives_goodput_against_one_replica_and_the_share_loaded_from_redis() -> None:
    calibration = Calibration(600, {"1x1": 1.0, "2x1-rr": 1.0}, {"1x1": 2.0, "2x1-rr": 2.0}, 0.5, 3.0, 3.0)
    cells = [_cell("1x1", [1.0, 5.0, 6.0], 0), _cell("2x1-rr", [1.0, 2.0, 5.0], 250)]
    config = {
        "server_flags": ["--kv-cache-gb", "0.3"], "docs": 4, "doc_words": 100, "max_tokens": 8,
        "requests": 3, "layouts": ["1x1", "2x1-rr"],
    }  # fmt: skip
    mix = MixInfo("popular", "a small pool", 10, 1.0, 0.25, 3)
    text = report(
        TrafficResult("kvsplice bench router", MachineInfo.collect(), config, calibration, [mix], cells)
    )
    assert "2x1-rr = 2 replicas of 1 thread, round_robin" in text and "SLO: TTFT <= 3.00 s" in text
    rows = {
        line.split(" | ")[2]: line.split(" | ") for line in text.splitlines() if line.startswith("| popular")
    }
    # Two of three requests within the SLO against one of three: 2x goodput; 250 of 1000 prompt tokens.
    assert rows["2x1-rr"][3:6] == ["2.00x", "60%", "25% |"]
    assert rows["1x1"][3] == "1.00x"


@pytest.mark.slow
def test_router_bench_against_real_deployments(monkeypatch, default_model_dir) -> None:
    """One replica and two behind vllm-router, one rate, two requests of short passages (about 90 s)."""
    monkeypatch.setattr(traffic, "CALIBRATION_REQUESTS", 1)
    config = TrafficConfig(
        mixes=("popular",), rates=(1.0,), requests=2, docs=2, doc_words=30, max_tokens=4,
        server_flags=("--kv-cache-gb", "0.25"),
    )  # fmt: skip
    result = run_router_traffic(config, ("1x1", "2x1-rr"))
    assert {c.system for c in result.cells} == {"1x1", "2x1-rr"}
    for cell in result.cells:
        assert [s.error for s in cell.sent] == [None, None]
        # The replicas' counters, summed, saw exactly the cell's requests, background work done.
        assert cell.compute.prompt_tokens == sum(s.prompt_tokens for s in cell.sent) > 0
        assert cell.agreement is not None and cell.agreement.samples == 1
    assert "| popular | 1.000 | 2x1-rr |" in report(result)
