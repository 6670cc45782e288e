"""The runner's FLOP count against torch's own FlopCounterMode, which counts the matrix products the
pass actually runs (attention on the math backend, so that its products are counted too).

The runner counts the keys each query sees; the math backend multiplies a query by every key up to the
chunk's last position, so the question here is short and at the end of the prompt, where the two agree
to within a key. A model without a sliding window (on a windowed layer the backend multiplies a tile's
whole key range, the runner only the window).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from kvsplice.models.build import load_model
from kvsplice.models.runner import ForwardChunk, ForwardResult, ModelRunner
from tests import tiny_models

LENGTH = 96
QUESTION = [LENGTH - 2, LENGTH - 1]


@pytest.fixture(scope="module")
def prefilled(tmp_path_factory: pytest.TempPathFactory) -> tuple[ModelRunner, list[int], list[int]]:
    directory = tmp_path_factory.mktemp("llama")
    tiny_models.save("LlamaForCausalLM", directory)
    model = load_model(directory, torch.float32, torch.device("cpu"))
    return tiny_models.prefilled_runner(model, LENGTH, seed=3)


def _counted(runner: ModelRunner, chunk: ForwardChunk) -> tuple[ForwardResult, int]:
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        result = runner.forward(chunk)
    return result, counter.get_total_flops()


def _question(runner: ModelRunner, table: list[int], ids: list[int]) -> ForwardChunk:
    return ForwardChunk(
        table, QUESTION, [ids[p] for p in QUESTION], range(runner.num_layers), need_logits=True
    )


def test_a_forward_pass_counts_what_torch_counts(prefilled) -> None:
    runner, table, ids = prefilled
    result, measured = _counted(runner, _question(runner, table, ids))
    assert result.flops == pytest.approx(measured, rel=0.01)
