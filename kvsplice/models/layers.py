"""Building blocks shared by the architecture files. Parameter names follow Hugging Face checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvsplice.kv import rope
from kvsplice.kv.context import ForwardContext
from kvsplice.model_config import ModelConfig

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class RMSNorm(nn.Module):
    """Llama-style: normalise in float32, scale by `weight` after casting back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma-style: the stored weight is an offset from 1, applied before casting back."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"activation {cfg.hidden_act!r} is not supported")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """Projections, optional per-head q/k norm, RoPE, then the pool's attention primitive."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        *,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: type[RMSNorm] | None,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
        self.q_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = qk_norm(cfg.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q_proj(x).view(batch, tokens, self.num_heads, self.head_dim)  # [B, T, Hq, D]
        k = self.k_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.rope(self.layer)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        out = ctx.attention(self.layer, q, k, v)
        return self.o_proj(out.reshape(batch, tokens, self.num_heads * self.head_dim))


class Backbone(nn.Module):
    """The `model.` part of a Hugging Face causal LM checkpoint."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: RMSNorm) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class CausalLM(nn.Module):
    """Embedding, a stack of decoder layers, final norm and LM head; the runner drives the layer loop.

    Holds parameters only (no buffers), so it can be built on the meta device and loaded by assignment.
    """

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module], norm: RMSNorm, embed_scale: float) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg, layers, norm)
        self.embed_scale = embed_scale
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [B, T] -> [B, T, hidden]."""
        h = self.model.embed_tokens(ids)
        if self.embed_scale != 1.0:
            # Gemma scales embeddings by sqrt(hidden), rounded to the weights' dtype as in its checkpoints.
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, hidden] (only the positions whose logits are needed) -> [N, vocab] float32."""
        # W @ h.T rather than h @ W.T: for a few rows against a tall (vocab x hidden) matrix the CPU
        # GEMM is several times faster this way round (batched decode of 8 rows: ~2.7x).
        logits = torch.mm(self.lm_head.weight, self.model.norm(h).T).T.float()
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
