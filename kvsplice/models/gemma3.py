"""Gemma 3 text models: interleaved sliding-window and global layers, each with its own RoPE base,
q/k norms, sandwich norms around attention and MLP, embeddings scaled by sqrt(hidden), tied head."""

from __future__ import annotations

import torch
from torch import nn

from kvsplice.kv.context import ForwardContext
from kvsplice.model_config import ModelConfig
from kvsplice.models.layers import Attention, CausalLM, GatedMLP, GemmaRMSNorm


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        bias = cfg.attention_bias
        self.self_attn = Attention(cfg, layer, qkv_bias=bias, o_bias=bias, qk_norm=GemmaRMSNorm)
        self.mlp = GatedMLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), ctx))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


def build(cfg: ModelConfig) -> CausalLM:
    layers: list[nn.Module] = [Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
    return CausalLM(cfg, layers, GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps), cfg.hidden_size**0.5)
