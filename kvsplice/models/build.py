"""Build a model on the meta device and load its weights from a Hugging Face directory by assignment,
so that weights stored in the compute dtype stay memory-mapped and peak memory stays near one copy."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from safetensors import safe_open

from kvsplice.errors import ModelLoadError
from kvsplice.model_config import ModelConfig
from kvsplice.models.layers import CausalLM
from kvsplice.models.registry import build_model, check_architecture

# Buffers some older checkpoints saved; kvsplice derives them from the config instead.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


# Engines in one process share a model's weights (they are never written): a benchmark can hold one
# engine per prefix-cache type for the price of one copy of the weights.
_LOADED: weakref.WeakValueDictionary[tuple[str, torch.dtype, str], CausalLM] = weakref.WeakValueDictionary()


def load_model(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    key = (str(path.resolve()), dtype, str(device))
    model = _LOADED.get(key)
    if model is None:
        model = _load(path, dtype, device)
        _LOADED[key] = model
    return model


def _load(path: Path, dtype: torch.dtype, device: torch.device) -> CausalLM:
    check_architecture(path)
    cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = build_model(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if not name.endswith(_IGNORED_SUFFIXES):
                    state[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        if "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = set(model.state_dict())
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ModelLoadError(
            f"weights in {path} do not match a {cfg.architecture}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
