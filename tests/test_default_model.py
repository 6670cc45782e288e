"""The default model (Gemma 3 270M from its GGUF) in kvsplice equals transformers' Gemma 3
on the same weights."""

from __future__ import annotations

import pytest
import torch

from kvsplice import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Question: What is the boiling point of water at sea level in Celsius?\nAnswer:",
    "Once upon a time, in a village by the sea, there lived",
]
# Longer than the 512-token sliding window of Gemma 3 270M's local layers.
LONG = " ".join(
    f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones." for i in range(70)
)


def _ids(llm, text: str) -> list[int]:
    return [llm.tokenizer.bos_token_id, *llm.tokenizer.encode(text)]


@pytest.mark.parametrize("text", [PROMPTS[0], PROMPTS[1], LONG])
def test_prefill_logits_equal_transformers(llm, hf_model, text: str) -> None:
    ids = _ids(llm, text)
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, return_first_logits=True))[0]
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
    if text is LONG:
        assert len(ids) > 600
    torch.testing.assert_close(out.first_logits, expected, atol=2e-3, rtol=1e-3)


def test_greedy_continuations_equal_transformers(llm, hf_model) -> None:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [_ids(llm, p) for p in PROMPTS]
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = hf_model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, min_new_tokens=32
            )
        assert out.token_ids == expected[0, len(ids) :].tolist(), llm.tokenizer.decode(ids)


def test_string_prompt_gets_bos_once(llm) -> None:
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.prompt_token_ids == _ids(llm, "The capital of France is")
    assert out.metrics.prompt_tokens == len(out.prompt_token_ids) == out.metrics.computed_tokens
