"""The Llama family: Llama 2/3 (llama3 RoPE scaling), Mistral (sliding window), Qwen2 (q/k/v bias),
Qwen3 (per-head q/k RMSNorm). Pre-norm decoder layers with a gated SiLU MLP."""

from __future__ import annotations

import torch
from torch import nn

from kvsplice.kv.context import ForwardContext
from kvsplice.model_config import ModelConfig
from kvsplice.models.layers import Attention, CausalLM, GatedMLP, RMSNorm


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        arch = cfg.architecture
        # Qwen2 always has q/k/v biases and no output bias; the others follow attention_bias.
        qkv_bias = cfg.attention_bias
        o_bias = cfg.attention_bias and arch != "Qwen2ForCausalLM"
        qk_norm = RMSNorm if arch == "Qwen3ForCausalLM" else None
        self.self_attn = Attention(cfg, layer, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
        self.mlp = GatedMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


def build(cfg: ModelConfig) -> CausalLM:
    layers: list[nn.Module] = [LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers)]
    return CausalLM(cfg, layers, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), 1.0)
