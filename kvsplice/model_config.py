"""An architecture-agnostic view of a Hugging Face config.json: what the runner needs, validated.

Hugging Face configs come in two dialects: transformers 4 writes `rope_theta` / `rope_scaling`
(and Gemma 3 `rope_local_base_freq`), transformers 5 writes `rope_parameters`, either one dict or
one per layer type. Both are read here, once, into per-layer settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsplice.errors import ModelLoadError

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class RopeSpec:
    """RoPE of one layer type. `scaling`: None, or the items of a dict with `rope_type`
    ('linear' | 'llama3') and its fields."""

    theta: float
    scaling: tuple[tuple[str, Any], ...] | None = None

    def scaling_dict(self) -> dict[str, Any]:
        return dict(self.scaling or ())


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    # One entry per layer: FULL or SLIDING.
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: dict[str, RopeSpec]
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    # Gemma 3 scales attention by query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    attn_scale: float
    final_logit_softcapping: float | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_dir(cls, path: Path) -> ModelConfig:
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{path} has no config.json; is it a Hugging Face model directory?")
        try:
            raw = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ModelLoadError(f"cannot read {config_path}: {err}") from err
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = raw.get("architectures") or []
        if not archs:
            raise ModelLoadError("config.json names no architecture ('architectures' is missing)")
        arch = archs[0]
        is_gemma3 = arch == "Gemma3ForCausalLM"
        try:
            num_layers = int(raw["num_hidden_layers"])
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            head_dim = int(raw.get("head_dim") or hidden // num_heads)
            layer_types = _layer_types(raw, num_layers, is_gemma3)
            rope = _rope_specs(raw, is_gemma3)
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            if raw.get("attn_logit_softcapping") is not None:
                raise ModelLoadError("attention logit soft-capping (Gemma 2) is not supported")
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                layer_types=layer_types,
                sliding_window=raw.get("sliding_window") if SLIDING in layer_types else None,
                rope=rope,
                hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", is_gemma3)),
                attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
                attn_scale=float(raw.get("query_pre_attn_scalar", head_dim) if is_gemma3 else head_dim)
                ** -0.5,
                final_logit_softcapping=raw.get("final_logit_softcapping"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as err:
            raise ModelLoadError(f"config.json lacks required field {err}") from err


def _layer_types(raw: dict[str, Any], num_layers: int, is_gemma3: bool) -> tuple[str, ...]:
    if raw.get("layer_types"):
        types = tuple(raw["layer_types"])
        if len(types) != num_layers or not set(types) <= {FULL, SLIDING}:
            raise ModelLoadError(f"config.json has invalid layer_types {types}")
        return types
    if is_gemma3:
        pattern = int(raw.get("sliding_window_pattern", 6))
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    if raw.get("sliding_window") is None:
        return (FULL,) * num_layers
    if "use_sliding_window" in raw:
        # Qwen2/Qwen3: the window applies only from layer max_window_layers on, and only if enabled.
        first = int(raw.get("max_window_layers", 28)) if raw["use_sliding_window"] else num_layers
        return tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return (SLIDING,) * num_layers


def _rope_specs(raw: dict[str, Any], is_gemma3: bool) -> dict[str, RopeSpec]:
    params = raw.get("rope_parameters")
    if params and all(k in (FULL, SLIDING) for k in params):
        return {kind: _spec(p, raw) for kind, p in params.items()}
    if params:
        spec = _spec(params, raw)
        return {FULL: spec, SLIDING: spec}
    full = _spec({"rope_theta": raw.get("rope_theta", 10000.0), **(raw.get("rope_scaling") or {})}, raw)
    if is_gemma3:
        # Gemma 3's local layers use their own base and are never scaled.
        return {FULL: full, SLIDING: RopeSpec(float(raw.get("rope_local_base_freq", 10000.0)))}
    return {FULL: full, SLIDING: full}


def _spec(p: dict[str, Any], raw: dict[str, Any]) -> RopeSpec:
    kind = p.get("rope_type", p.get("type", "default"))
    theta = float(p.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeSpec(theta)
    if kind == "linear":
        return RopeSpec(theta, (("rope_type", "linear"), ("factor", float(p["factor"]))))
    if kind == "llama3":
        fields = {
            "rope_type": "llama3",
            "factor": float(p["factor"]),
            "low_freq_factor": float(p["low_freq_factor"]),
            "high_freq_factor": float(p["high_freq_factor"]),
            "original_max_position_embeddings": int(
                p.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
            ),
        }
        return RopeSpec(theta, tuple(fields.items()))
    raise ModelLoadError(f"RoPE type {kind!r} is not supported (supported: default, linear, llama3)")
