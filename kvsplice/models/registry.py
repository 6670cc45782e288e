"""Architectures kvsplice runs, keyed by the Hugging Face architecture name in config.json."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvsplice.errors import ModelLoadError
from kvsplice.model_config import ModelConfig
from kvsplice.models import gemma3, llama
from kvsplice.models.layers import CausalLM

ARCHITECTURES: dict[str, Callable[[ModelConfig], CausalLM]] = {
    "Gemma3ForCausalLM": gemma3.build,
    "LlamaForCausalLM": llama.build,
    "MistralForCausalLM": llama.build,
    "Qwen2ForCausalLM": llama.build,
    "Qwen3ForCausalLM": llama.build,
}


def build_model(cfg: ModelConfig) -> CausalLM:
    assert cfg.architecture in ARCHITECTURES, "check_architecture runs before the config is read"
    return ARCHITECTURES[cfg.architecture](cfg)


def check_architecture(model_dir: Path) -> None:
    """Refuse a model directory whose config.json names an architecture kvsplice does not run, before
    its other fields are read (they differ between families)."""
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return  # ModelConfig.from_dir reports a missing or unreadable config.json
    arch = (raw.get("architectures") or [None])[0]
    if arch is not None and arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"architecture {arch!r} is not supported; kvsplice runs {', '.join(sorted(ARCHITECTURES))}"
        )
