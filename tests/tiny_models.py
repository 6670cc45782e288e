"""Tiny random-weight models of every supported architecture, built with transformers (no downloads)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as tf

from kvsplice.kv.pool import KVPool
from kvsplice.model_config import ModelConfig
from kvsplice.models.layers import CausalLM
from kvsplice.models.runner import ModelRunner

COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    # Large enough weights that next-token distributions are peaked: greedy choices have clear margins.
    initializer_range=0.1,
)
WINDOW = 24


def _config(arch: str) -> tf.PreTrainedConfig:
    if arch == "Gemma3ForCausalLM":
        return tf.Gemma3TextConfig(
            **COMMON,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            },
        )
    if arch == "LlamaForCausalLM":
        llama3 = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return tf.LlamaConfig(**COMMON, rope_parameters=llama3)
    if arch == "MistralForCausalLM":
        return tf.MistralConfig(**COMMON, sliding_window=WINDOW)
    if arch == "Qwen2ForCausalLM":
        return tf.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    if arch == "Qwen3ForCausalLM":
        return tf.Qwen3Config(**COMMON)
    raise AssertionError(arch)


ARCHITECTURES = (
    "Gemma3ForCausalLM",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


def build(arch: str, seed: int = 0) -> tf.PreTrainedModel:
    torch.manual_seed(seed)
    config = _config(arch)
    config.architectures = [arch]
    model = getattr(tf, arch)(config).eval()
    with torch.no_grad():
        # Random init leaves norms at their identity and biases at zero; perturb them so a wrong
        # norm formula or a dropped bias shows up in the logits.
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.2)
    return model


def save(arch: str, directory: Path, seed: int = 0) -> tf.PreTrainedModel:
    model = build(arch, seed)
    model.save_pretrained(directory)
    return model


def prefilled_runner(model: CausalLM, length: int, seed: int) -> tuple[ModelRunner, list[int], list[int]]:
    """A runner over a fresh pool holding a full prefill of `length` random tokens (drawn with `seed`):
    the runner, the sequence's block table and its token ids."""
    pool = KVPool(model.cfg, 1 << 22, 8, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, pool)
    table = pool.allocator.allocate(-(-length // 8))
    ids = torch.randint(0, COMMON["vocab_size"], (length,), generator=torch.Generator().manual_seed(seed))
    runner.prefill(table, ids.tolist(), list(range(length)))
    return runner, table, ids.tolist()


def llama_config() -> ModelConfig:
    """The tiny Llama's configuration (no sliding window), for policies that read the model's layers."""
    return ModelConfig.from_dict(
        {**COMMON, "architectures": ["LlamaForCausalLM"], "rope_theta": 10000.0, "rms_norm_eps": 1e-6}
    )
