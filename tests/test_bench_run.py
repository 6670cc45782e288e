"""`kvsplice bench` end to end: on a tiny random-weight model (token-id workloads, a few seconds), and
once on the default model (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsplice.bench import BenchConfig, BenchResult, WorkloadSpec, run_bench, write_report
from kvsplice.bench.systems import default_systems
from kvsplice.cli import main
from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.reuse import segment_kv
from tests import tiny_models

SMALL = WorkloadSpec(requests=2, docs=3, pool=4, turns=3, doc_words=40)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-gemma3")
    tiny_models.save("Gemma3ForCausalLM", directory)
    return directory


def _config(workload: str, model: Path, **kwargs) -> BenchConfig:
    engine = EngineConfig(model=str(model), num_threads=1)
    base = dict(spec=SMALL, engine=engine, continuation=4, progress=False, kv_cache_gb=0.2)
    base.update(kwargs)
    return BenchConfig(workload, **base)  # type: ignore[arg-type]


def test_rag_side_by_side_on_a_tiny_model(tiny_dir: Path, tmp_path: Path) -> None:
    result = run_bench(_config("rag", tiny_dir, systems=("hash", "radix", "splice"), budgets=(15.0, 30.0)))
    systems = result.systems
    n = len(systems)
    assert systems[:3] == ["off", "hash", "radix"] and "splice:full@100" in systems
    assert {s.name for s in default_systems()} < set(systems)
    warmups = {r.request_id for r in result.records if r.warmup}
    measured = {r.request_id for r in result.records if not r.warmup}
    assert len(measured) == 2 and warmups
    # Every system ran every request (the reference skips warm-ups), and none failed.
    assert len(result.records) == n * len(measured) + (n - 1) * len(warmups)
    assert all(r.ok for r in result.records)
    by = {s.system: s for s in result.summaries}
    # Exact systems match the full prefill; splicing reuses documents that prefix caches cannot.
    for name in ("off", "hash", "radix", "splice:full@100"):
        assert by[name].kl_mean is not None and by[name].kl_mean < 1e-6, name
        assert by[name].same_rate == 1.0 and by[name].top1_rate == 1.0, name
    for name in ("hash", "radix"):
        assert by[name].segment_hit_frac == 0
    for name in systems[3:]:
        assert (by[name].segment_hit_frac or 0) > 0.5, name
        assert (by[name].prefix_hit_frac or 0) < (by[name].segment_hit_frac or 0)
    assert by["splice:none@0"].computed_frac < by["splice:deviation@30"].computed_frac < 1  # type: ignore[operator]
    assert by["radix"].peak_kv_bytes > by["off"].peak_kv_bytes  # type: ignore[operator]
    assert result.model is not None and not result.model.has_tokenizer
    assert all(s.accuracy is None for s in result.summaries)  # no tokenizer: no text to check

    report = write_report(result, tmp_path)
    assert (tmp_path / "report.md").read_text() == report
    for name in ("results.json", "frontier.png", "reuse.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| splice:deviation@15 | 2/2 |" in report and "### Per turn" not in report
    assert BenchResult.from_json((tmp_path / "results.json").read_text()) == result


def test_a_failing_system_is_shown_failed_and_the_rest_still_run(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    add_request = Engine.add_request

    def flaky(self, prompt, params, options=None, **kwargs):  # type: ignore[no-untyped-def]
        if options is not None and options.cache_salt == "splice:deviation@15" and len(self._requests) == 0:
            flaky.calls += 1  # type: ignore[attr-defined]
            if flaky.calls == 3:  # type: ignore[attr-defined]
                raise RuntimeError("injected failure")
        return add_request(self, prompt, params, options, **kwargs)

    flaky.calls = 0  # type: ignore[attr-defined]
    monkeypatch.setattr(Engine, "add_request", flaky)
    result = run_bench(_config("chat", tiny_dir, systems=("hash", "radix", "splice:deviation@15")))
    failed = [(r.system, r.error) for r in result.records if not r.ok]
    assert failed == [("splice:deviation@15", "RuntimeError: injected failure")]
    summary = {s.system: s for s in result.summaries}["splice:deviation@15"]
    assert (summary.requests, summary.failed) == (6, 1)
    assert len(result.records) == 4 * 6
    report = write_report(result, tmp_path)
    assert "5/6 (**1 failed**)" in report and "injected failure" in report
    assert "### Per turn" in report and (tmp_path / "turns.png").exists()
    # Per turn, the prefix caches compute only what the previous turn did not have.
    turns = {(t.turn, t.system): t for t in result.turns}
    assert turns[(2, "radix")].computed_mean < turns[(2, "off")].computed_mean  # type: ignore[operator]


def test_cli_runs_a_bench_and_refuses_bad_names(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["bench", "qa", "--model", str(tiny_dir), "--requests", "1", "--docs", "2", "--pool", "3"]
    args += ["--doc-words", "30", "--continuation", "2", "--num-threads", "1", "--no-progress"]
    args += ["--systems", "radix", "splice:none@0", "--out", str(tmp_path), "--no-plots"]
    # Engine options are EngineConfig's flags, as for kvsplice serve.
    args += ["--block-size", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    # The terminal gets the headline; report.md has every column too.
    assert "| splice:none@0 | " in out and "# kvsplice bench: qa" in out and "## Details" not in out
    assert f"Every column, notes and plots: {tmp_path / 'report.md'}" in out
    assert "| splice:none@0 | 1/1 |" in (tmp_path / "report.md").read_text()
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["systems"] == ["off", "radix", "splice:none@0"]
    assert saved["model"]["block_size"] == 8
    assert not (tmp_path / "frontier.png").exists()

    assert main(["bench", "rag", "--systems", "splice:lru"]) == 2
    assert "unknown repair policy 'lru'" in capsys.readouterr().err
    assert main(["bench", "rag", "--docs", "9", "--pool", "3"]) == 2


@pytest.mark.slow
def test_default_model_rag_smoke(tmp_path: Path) -> None:
    """The real model on a small rag run (< 60 s): exact systems match, splicing reuses documents."""
    spec = WorkloadSpec(requests=1, docs=3, pool=3, doc_words=50)
    config = BenchConfig(
        "rag",
        spec,
        systems=("radix", "splice:none@0", "splice:full@100"),
        continuation=4,
        progress=False,
        kv_cache_gb=0.5,
        # One thread: on a busy 2-core machine two threads wait on each other (4x slower here).
        engine=EngineConfig(num_threads=1),
    )
    result = run_bench(config)
    by = {s.system: s for s in result.summaries}
    assert all(r.ok for r in result.records)
    assert by["radix"].kl_mean < 1e-4 and by["splice:full@100"].kl_mean < 1e-3  # type: ignore[operator]
    assert (by["splice:none@0"].segment_hit_frac or 0) > 0.5
    assert by["splice:none@0"].computed_frac < 0.2  # type: ignore[operator]
    # The pools are sized for everything the run writes, 1,024-token contexts and their samples too.
    assert not [n for n in result.notes if "evicted" in n or "dropped the lead KV" in n], result.notes
    assert any(n.startswith("segment_lead_kv: the segment store computed") for n in result.notes)
    # The measured request reuses documents the warm-ups carried: seen again, they are computed after
    # more contexts in the background, and that work is counted for it.
    spliced = [r for r in result.records if r.system.startswith("splice:") and not r.warmup]
    assert all(r.background_flops > 0 and r.segment_lead_tokens <= r.segment_hit_tokens for r in spliced)
    by_system = {r.system: r for r in spliced}
    assert by["splice:none@0"].total_flops_frac > by["splice:none@0"].flops_frac  # type: ignore[operator]
    assert by_system["splice:none@0"].background_flops > 0
    assert any("were spliced from lead KV" in n for n in result.notes), result.notes
    assert result.model is not None and result.model.has_tokenizer
    assert "| splice:none@0 | 1/1 |" in write_report(result, tmp_path)


def test_a_capped_pool_is_noted_and_its_evictions_reported(tiny_dir: Path) -> None:
    bytes_per_block = 2 * 4 * 16 * 2 * 16 * 4  # layers, block size, KV heads, head dim, float32
    config = _config("rag", tiny_dir, systems=("radix",), kv_cache_gb=25 * bytes_per_block / 2**30)
    result = run_bench(config)
    assert all(r.ok for r in result.records)
    notes = " ".join(result.notes)
    assert "cut: radix" in notes and "radix engine's radix tree evicted" in notes


def test_a_run_after_a_restart_loads_the_documents_from_the_disk_tier(tiny_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    systems = ("splice:attention@15",)
    first = run_bench(_config("rag", tiny_dir, systems=systems, engine=_store_engine(tiny_dir, store)))
    # The first process wrote every document to disk; only the splice engine has tiers.
    assert set(first.tier_stats) == {"splice"}
    written = first.tier_stats["splice"]["disk"]["writes"]
    assert written >= SMALL.pool
    assert first.tier_stats["splice"]["disk"]["hits"] == 0
    # A new process (a fresh engine) without warm-ups: the documents are new to its pool and come from disk.
    again = run_bench(
        _config("rag", tiny_dir, systems=systems, engine=_store_engine(tiny_dir, store), skip_warmup=True)
    )
    assert not any(r.warmup for r in again.records)
    spliced = [r for r in again.records if r.system == "splice:attention@15"]
    assert sum(r.store_hit_tokens.get("disk", 0) for r in spliced) > 0
    assert all(r.store_hit_tokens.get("disk", 0) <= r.segment_hit_tokens for r in spliced)
    assert spliced[0].store_load_s > 0
    # Every document is looked up below the pool once and read back from the disk.
    disk = again.tier_stats["splice"]["disk"]
    assert disk["hits"] == SMALL.pool and disk["misses"] == 0
    # Loaded documents are not store fill: nothing was missed, so nothing was put in the store.
    assert all(r.store_tokens == 0 for r in spliced)
    summary = {s.system: s for s in again.summaries}["splice:attention@15"]
    assert summary.tier_hit_frac["disk"] > 0 and summary.store_load_mean_s is not None
    assert again.tier_stats["splice"]["disk"]["hits"] > 0
    assert again.tier_stats["splice"]["disk"]["corrupt"] == 0
    # Without the tier, the same requests compute their documents: nothing comes from below the pool.
    cold = run_bench(_config("rag", tiny_dir, systems=systems, skip_warmup=True))
    assert cold.tier_stats == {}
    assert all(not r.store_hit_tokens for r in cold.records)
    report = write_report(again, tmp_path / "out", plots=False)
    assert "### Store tiers" in report and "from disk" in report
    assert "### Store tiers" not in write_report(cold, tmp_path / "cold", plots=False)
    saved = BenchResult.from_json((tmp_path / "out" / "results.json").read_text())
    assert saved.tier_stats == again.tier_stats


def _store_engine(model: Path, store: Path) -> EngineConfig:
    return EngineConfig(model=str(model), num_threads=1, store={"store_dir": str(store)})


def test_extra_segment_contexts_are_noted_with_their_cost(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The note says what the extra contexts cost. The tiny model has no tokenizer, so no canonical
    context to vary: no context is computed (the default model's: tests/test_segment_contexts.py)."""
    engine = EngineConfig(model=str(tiny_dir), num_threads=1)
    monkeypatch.setattr(segment_kv, "CONTEXTS", 3)
    result = run_bench(_config("rag", tiny_dir, systems=("splice:attention@15",), engine=engine))
    assert all(r.ok for r in result.records)
    note = next(n for n in result.notes if n.startswith("segment_contexts=3"))
    assert " 0 tokens" in note and "0% of the measured" in note and "0 contexts dropped" in note
    monkeypatch.setattr(segment_kv, "CONTEXTS", 1)
    plain = run_bench(_config("rag", tiny_dir, systems=("splice:attention@15",), engine=engine))
    assert not any(n.startswith("segment_contexts") for n in plain.notes)


def test_the_model_familys_segment_shift_is_noted(tiny_dir: Path) -> None:
    """A Gemma 3 engine repairs with the segment shift: the report says so."""
    default = run_bench(_config("rag", tiny_dir, systems=("splice:attention@15",)))
    assert any("segment shift at 0.5" in n for n in default.notes)
