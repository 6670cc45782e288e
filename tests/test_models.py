"""The runner's logits equal transformers' on the same weights, for every supported architecture,
with prompts longer than the sliding window, in every way the engine calls the runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvsplice.errors import ModelLoadError
from kvsplice.kv.pool import KVPool
from kvsplice.models.build import load_model
from kvsplice.models.runner import DecodeItem, ModelRunner
from tests import tiny_models

TOL = dict(atol=2e-5, rtol=1e-4)
LENGTH = 80  # > 3 sliding windows of the tiny models


@pytest.fixture(scope="module", params=tiny_models.ARCHITECTURES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    reference = tiny_models.save(request.param, directory)
    ours = load_model(directory, torch.float32, torch.device("cpu"))
    return reference, ours


def _runner(model) -> tuple[ModelRunner, list[int]]:
    pool = KVPool(model.cfg, 1 << 24, 8, torch.float32, torch.device("cpu"))
    return ModelRunner(model, pool), pool.allocator.allocate(-(-(LENGTH + 8) // 8))


def _reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids[None]).logits[0]  # [T, vocab]


def test_prefill_then_cached_prefill_then_decode_match(pair) -> None:
    reference, ours = pair
    ids = torch.randint(0, 320, (LENGTH,), generator=torch.Generator().manual_seed(1))
    expected = _reference_logits(reference, ids)
    runner, table = _runner(ours)
    # A full prefill of the first 50 tokens, then a prefill of 29 more on top of the cached 50,
    # then one decode step: each one's last logits match the reference at that position.
    torch.testing.assert_close(
        runner.prefill(table, ids.tolist(), list(range(50))).logits, expected[49], **TOL
    )
    torch.testing.assert_close(
        runner.prefill(table, ids.tolist(), list(range(50, 79))).logits, expected[78], **TOL
    )
    decoded = runner.decode([DecodeItem(table, int(ids[79]), 79)]).logits[0]
    torch.testing.assert_close(decoded, expected[79], **TOL)


def test_every_decode_step_matches_recomputing_the_sequence(pair) -> None:
    _, ours = pair
    ids = torch.randint(0, 320, (LENGTH,), generator=torch.Generator().manual_seed(2)).tolist()
    runner, table = _runner(ours)
    runner.prefill(table, ids, list(range(40)))
    for position in range(40, LENGTH):
        step = runner.decode([DecodeItem(table, ids[position], position)]).logits[0]
        _, fresh = _runner(ours)
        recomputed = runner.prefill(fresh, ids, list(range(position + 1))).logits
        torch.testing.assert_close(step, recomputed, **TOL)


def test_scattered_query_subset_matches(pair) -> None:
    """Recomputing an arbitrary subset of tokens over otherwise valid KV reproduces the same logits."""
    reference, ours = pair
    ids = torch.randint(0, 320, (LENGTH,), generator=torch.Generator().manual_seed(3))
    expected = _reference_logits(reference, ids)
    runner, table = _runner(ours)
    runner.prefill(table, ids.tolist(), list(range(LENGTH)))
    subset = sorted({3, 17, 18, 40, 41, 42, 63, LENGTH - 1})
    torch.testing.assert_close(runner.prefill(table, ids.tolist(), subset).logits, expected[-1], **TOL)


def test_batched_decode_of_unequal_sequences_matches(pair) -> None:
    reference, ours = pair
    pool = KVPool(ours.cfg, 1 << 24, 8, torch.float32, torch.device("cpu"))
    runner = ModelRunner(ours, pool)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 320, (n,), generator=gen) for n in (70, 31, 5)]
    tables = [pool.allocator.allocate(-(-len(s) // 8)) for s in seqs]
    for seq, table in zip(seqs, tables, strict=True):
        runner.prefill(table, seq.tolist(), list(range(len(seq) - 1)))
    items = [DecodeItem(t, int(s[-1]), len(s) - 1) for s, t in zip(seqs, tables, strict=True)]
    logits = runner.decode(items).logits
    for row, seq in zip(logits, seqs, strict=True):
        torch.testing.assert_close(row, _reference_logits(reference, seq)[-1], **TOL)


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 1}')
    with pytest.raises(ModelLoadError, match="not supported"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        load_model(tmp_path, torch.float32, torch.device("cpu"))
