"""What a pass costs, in FLOPs, by formula: the runner's accounting of what it ran.

Counted: each layer's projections and MLP, attention scores and mixing over the keys each query sees
(its window on a sliding-window layer), and the LM head. Not counted: norms, RoPE, activations,
softmax (each linear in the tokens, and small beside the products). The runner's count of a forward
is checked against torch's FlopCounterMode (tests/test_runner_flops.py).
"""

from __future__ import annotations

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
