"""config.json for a GGUF, from its metadata: one function per architecture, transformers' field names.

llama.cpp keys are `<architecture>.<name>` (`llama.block_count`); a missing required key is a
`ModelLoadError`. Floats in a GGUF are float32, so they are written as the decimal they came from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvsplice.errors import ModelLoadError
from kvsplice.loader.gguf_tokenizer import GgufVocab


def _float32_value(value: float) -> float:
    """A GGUF float32 as the decimal it was written from: 9.99999997e-07 -> 1e-06."""
    return float(str(np.float32(value)))


def _required(metadata: dict[str, Any], architecture: str) -> Callable[[str], Any]:
    def key(name: str) -> Any:
        full = f"{architecture}.{name}"
        if full not in metadata:
            raise ModelLoadError(f"{architecture} GGUF lacks the metadata key {full!r}")
        return metadata[full]

    return key


def gemma3_config(metadata: dict[str, Any], vocab: GgufVocab, tied: bool) -> dict[str, Any]:
    """Gemma 3 text: transformers' Gemma3TextConfig fields."""
    key = _required(metadata, "gemma3")
    layers, hidden, heads = key("block_count"), key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length")
    # What follows is not in the GGUF (or only in newer ones); the defaults are Gemma 3's, as in
    # llama.cpp: every 6th layer attends globally, the local layers use rope base 10000, and queries
    # are scaled by head_dim**-0.5 except on the 27B (62 layers), which uses (hidden / heads)**-0.5.
    pattern = metadata.get("gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True where the layer uses the sliding window
        sliding = [bool(is_sliding) for is_sliding in pattern]
    else:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]
    if len(sliding) != layers:
        raise ModelLoadError(f"sliding_window_pattern covers {len(sliding)} layers, the model has {layers}")
    local_rope_theta = _float32_value(metadata.get("gemma3.rope.freq_base_swa", 10000.0))
    query_pre_attn_scalar = hidden // heads if layers == 62 else head_dim

    full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _float32_value(key("rope.freq_base"))}
    scaling = metadata.get("gemma3.rope.scaling.type", "none")
    factor = _float32_value(metadata.get("gemma3.rope.scaling.factor", 1.0))
    if scaling == "linear" and factor != 1.0:  # Gemma 3 4B and up stretch only the global layers' rope
        full_rope = {**full_rope, "rope_type": "linear", "factor": factor}
    elif scaling not in ("none", "linear"):
        raise ModelLoadError(f"gemma3 GGUF uses rope scaling {scaling!r}; kvsplice supports only 'linear'")

    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": len(vocab.tokens),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": key("context_length"),
        "sliding_window": key("attention.sliding_window"),
        "layer_types": ["sliding_attention" if is_sliding else "full_attention" for is_sliding in sliding],
        "rope_parameters": {
            "full_attention": full_rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_rope_theta},
        },
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "tie_word_embeddings": tied,
        "bos_token_id": vocab.bos_id,
        "eos_token_id": vocab.eos_id,
        "pad_token_id": vocab.pad_id,
    }


def llama_config(metadata: dict[str, Any], vocab: GgufVocab, tied: bool) -> dict[str, Any]:
    """Llama (and the models llama.cpp files under it, like SmolLM2): transformers' LlamaConfig fields.

    Every layer attends to the whole context (llama.cpp's llama graph has no sliding window), RoPE
    covers the whole head, and the only rope scaling a GGUF can describe in metadata is linear
    (llama3-style scaling comes as a `rope_freqs` tensor, which `plan_tensors` refuses).
    """
    key = _required(metadata, "llama")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = metadata.get("llama.attention.key_length", hidden // heads)
    rotary_dims = metadata.get("llama.rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        raise ModelLoadError(f"llama GGUF rotates {rotary_dims} of {head_dim} head dims, not all of them")
    if metadata.get("llama.attention.value_length", head_dim) != head_dim:
        raise ModelLoadError("llama GGUF has value heads of another size than its key heads")

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": _float32_value(key("rope.freq_base"))}
    scaling = metadata.get("llama.rope.scaling.type", "none")
    factor = _float32_value(metadata.get("llama.rope.scaling.factor", 1.0))
    if scaling == "linear" and factor != 1.0:
        rope = {**rope, "rope_type": "linear", "factor": factor}
    elif scaling not in ("none", "linear"):
        raise ModelLoadError(f"llama GGUF uses rope scaling {scaling!r}; kvsplice supports only 'linear'")

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(vocab.tokens),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": metadata.get("llama.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(key("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": key("context_length"),
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": vocab.bos_id,
        "eos_token_id": vocab.eos_id,
        "pad_token_id": vocab.pad_id,
    }


# general.architecture -> its config.json; the architectures kvsplice converts.
CONFIGS: dict[str, Callable[[dict[str, Any], GgufVocab, bool], dict[str, Any]]] = {
    "gemma3": gemma3_config,
    "llama": llama_config,
}
