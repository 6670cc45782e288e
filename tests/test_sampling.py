"""The sampler on hand-made logits: which tokens each setting can produce, and seeded determinism."""

from __future__ import annotations

import torch

from kvsplice.sampling import SamplingParams, sample

LOGITS = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))


def _draws(params: SamplingParams, n: int = 400) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample(LOGITS, params, gen) for _ in range(n)}


def test_greedy_and_tiny_temperatures_take_the_argmax() -> None:
    assert _draws(SamplingParams(temperature=0.0), 20) == {0}
    assert _draws(SamplingParams(temperature=1e-30), 20) == {0}


def test_top_k_keeps_the_k_most_likely() -> None:
    assert _draws(SamplingParams(top_k=2)) == {0, 1}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # 0.5 + 0.2 = 0.7 < 0.75, so the third token (crossing 0.75) is kept too, the rest never.
    assert _draws(SamplingParams(top_p=0.75)) == {0, 1, 2}
    assert _draws(SamplingParams(top_p=0.4)) == {0}


def test_plain_sampling_reaches_every_token_in_proportion() -> None:
    gen = torch.Generator().manual_seed(1)
    counts = torch.bincount(
        torch.tensor([sample(LOGITS, SamplingParams(), gen) for _ in range(4000)]), minlength=5
    )
    torch.testing.assert_close(counts / 4000, LOGITS.exp(), atol=0.03, rtol=0)


def test_same_seed_same_draws() -> None:
    def run(seed: int) -> list[int]:
        gen = torch.Generator().manual_seed(seed)
        return [sample(LOGITS, SamplingParams(temperature=1.3), gen) for _ in range(50)]

    assert run(3) == run(3) and run(3) != run(4)
