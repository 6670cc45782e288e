"""What a pass costs, in FLOPs, by formula: the runner's accounting of what it ran, and a policy's
estimate of what its passes will cost before it asks for them (repair/margin.py).

Counted: each layer's projections and MLP, attention scores and mixing over the keys each query sees
(its window on a sliding-window layer), and the LM head. Not counted: norms, RoPE, activations,
softmax (each linear in the tokens, and small beside the products). The runner's count of a forward
and of an attributed pass is checked against torch's FlopCounterMode (tests/test_runner_flops.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvsplice.model_config import ModelConfig


@dataclass(frozen=True)
class FlopModel:
    cfg: ModelConfig

    @property
    def layer_macs(self) -> int:
        """Multiply-adds of one token through one layer's projections (q, k, v, o) and gated MLP."""
        c = self.cfg
        attention = 2 * c.hidden_size * (c.num_heads + c.num_kv_heads) * c.head_dim
        return attention + 3 * c.hidden_size * c.intermediate_size

    def dense(self, tokens: int) -> float:
        """One layer's projections and MLP for `tokens` queries."""
        return 2.0 * tokens * self.layer_macs

    def attention(self, positions: torch.Tensor, layer: int) -> float:
        """One layer's attention scores and mixing for the queries at `positions`, over the keys each sees."""
        window = self.cfg.window(layer)
        visible = positions + 1 if window is None else (positions + 1).clamp(max=window)
        return 4.0 * self.cfg.num_heads * self.cfg.head_dim * float(visible.sum())

    def head(self, rows: int) -> float:
        return 2.0 * rows * self.cfg.hidden_size * self.cfg.vocab_size

    def forward(self, positions: Sequence[int], layers: range) -> float:
        """The queries at `positions` through `layers` (no LM head)."""
        return sum(self._split(positions, layers))

    def attributed(self, positions: Sequence[int], layers: range) -> float:
        """The same with the backward of a margin attribution (`with_backward`)."""
        return with_backward(*self._split(positions, layers))

    def _split(self, positions: Sequence[int], layers: range) -> tuple[float, float]:
        """The projections' and the attention's FLOPs of the queries at `positions` through `layers`."""
        at = torch.tensor(list(positions), dtype=torch.int64)
        return len(layers) * self.dense(len(at)), sum(self.attention(at, i) for i in layers)


def with_backward(dense: float, attention: float) -> float:
    """A pass's FLOPs with the backward of a margin attribution, from its forward's `dense` (projections,
    MLP, LM head) and `attention` FLOPs. The backward takes input gradients only, no weight's: one more
    product per projection, two more per attention product (scores and mixing each pass a gradient to
    both operands). Measured by torch's FlopCounterMode (math attention) on a question of 40 tokens over
    2048: 2.39x the forward on SmolLM2, 2.21x on Gemma 3, as this counts but for the first layer's input
    gradients, which autograd skips (tests/test_runner_flops.py)."""
    return 2 * dense + 3 * attention
