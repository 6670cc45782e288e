"""Sampling parameters (vLLM's names and defaults) and the sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvsplice.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1: no top-k filtering.
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str = field(default_factory=tuple)
    ignore_eos: bool = False
    # Keep the full float32 logits of the first generated position (fidelity measurements).
    return_first_logits: bool = False

    def __post_init__(self) -> None:
        def bad(message: str) -> None:
            raise InvalidRequestError(f"invalid sampling parameters: {message}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            not isinstance(self.temperature, int | float)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            bad("stop must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        # Below vLLM's threshold a temperature only overflows the softmax: treat it as greedy.
        return self.temperature < 1e-5


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """logits: [vocab] float32 -> the next token id."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def top_margin(logits: torch.Tensor) -> float:
    """The most likely token's probability minus the runner-up's, under logits [vocab]."""
    top = logits.float().softmax(-1).topk(2).values
    return float(top[0] - top[1])


def kl_divergence(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(P_ref || P) in nats, from logits [vocab] (computed in float64)."""
    log_p = torch.log_softmax(reference.double(), -1)
    log_q = torch.log_softmax(logits.double(), -1)
    return max(0.0, float((log_p.exp() * (log_p - log_q)).sum()))
