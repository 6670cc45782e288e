"""Architectures kvsplice runs, keyed by the Hugging Face architecture name in config.json."""

from __future__ import annotations

from collections.abc import Callable

from kvsplice.models import gemma3, llama
from kvsplice.models.config import ModelConfig
from kvsplice.models.layers import CausalLM

ARCHITECTURES: dict[str, Callable[[ModelConfig], CausalLM]] = {
    "Gemma3ForCausalLM": gemma3.build,
    "LlamaForCausalLM": llama.build,
    "MistralForCausalLM": llama.build,
    "Qwen2ForCausalLM": llama.build,
    "Qwen3ForCausalLM": llama.build,
}


def build_model(cfg: ModelConfig) -> CausalLM:
    assert cfg.architecture in ARCHITECTURES, "ModelConfig checks the architecture"
    return ARCHITECTURES[cfg.architecture](cfg)
