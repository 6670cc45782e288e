"""A gemma3 GGUF's model: config.json from its metadata, and its tensors dequantised into model.safetensors.

GGUF tensor names are mapped to Hugging Face Gemma 3 names and every tensor's shape is checked
against the config before anything is written; the weights are then written as float32, a chunk
at a time, with llama.cpp's stored RMSNorm weights (1 + w) turned back into transformers' w.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
from tqdm import tqdm

from kvsplice.errors import ModelLoadError
from kvsplice.loader.gguf_file import GgufTensor
from kvsplice.loader.gguf_tokenizer import GgufVocab

# Dequantise this many values at a time, so the 262144 x 640 embedding never exists twice in memory.
_CHUNK_VALUES = 1 << 23

# GGUF tensor names -> Hugging Face Gemma 3 names; per-layer ones live under model.layers.{i}.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # only in files whose output is not tied to the embedding
}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


class TensorPlan(NamedTuple):
    """One GGUF tensor and where it goes in model.safetensors."""

    tensor: GgufTensor
    hf_name: str
    shape: tuple[int, ...]  # Hugging Face order: [out_features, in_features] for a linear weight


def _float32_value(value: float) -> float:
    """A GGUF float32 as the decimal it was written from: 9.99999997e-07 -> 1e-06."""
    return float(str(np.float32(value)))


def gemma3_config(metadata: dict[str, Any], vocab: GgufVocab, tied: bool) -> dict[str, Any]:
    """config.json for a gemma3 GGUF: transformers' Gemma3TextConfig fields, readable as plain JSON."""

    def key(name: str) -> Any:
        full = f"gemma3.{name}"
        if full not in metadata:
            raise ModelLoadError(f"gemma3 GGUF lacks the metadata key {full!r}")
        return metadata[full]

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


def plan_tensors(tensors: list[GgufTensor], config: dict[str, Any], path: Path) -> list[TensorPlan]:
    """Name and check every tensor before writing anything: unknown, missing or misshapen ones fail."""
    expected = _expected_shapes(config)
    plans = []
    for tensor in tensors:
        hf_name = hf_tensor_name(tensor.name)
        if hf_name is None or hf_name not in expected:
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r} for this gemma3 config")
        shape = tuple(int(dim) for dim in reversed(tensor.shape))  # ggml lists the fastest axis first
        if shape != expected[hf_name]:
            raise ModelLoadError(f"{path}: {tensor.name} has shape {shape}, expected {expected[hf_name]}")
        plans.append(TensorPlan(tensor, hf_name, shape))
    missing = sorted(set(expected) - {plan.hf_name for plan in plans})
    if missing:
        raise ModelLoadError(f"{path}: tensors missing for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return plans


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_TENSORS:
        return None
    return f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}.weight"


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    per_layer = {
        "self_attn.q_proj": (q_dim, hidden),
        "self_attn.k_proj": (kv_dim, hidden),
        "self_attn.v_proj": (kv_dim, hidden),
        "self_attn.o_proj": (hidden, q_dim),
        "self_attn.q_norm": (config["head_dim"],),
        "self_attn.k_norm": (config["head_dim"],),
        "input_layernorm": (hidden,),
        "post_attention_layernorm": (hidden,),
        "pre_feedforward_layernorm": (hidden,),
        "post_feedforward_layernorm": (hidden,),
        "mlp.gate_proj": (inter, hidden),
        "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}.weight"] = shape
    return shapes


def _dequantized_chunks(plan: TensorPlan) -> Iterator[np.ndarray]:
    """The tensor as float32 in row chunks, Hugging Face layout. llama.cpp stores Gemma's RMSNorm
    weights as 1 + w (Gemma's norm multiplies by 1 + w); transformers' Gemma3 expects w."""
    data = plan.tensor.data  # HF order: [rows, values per row], or [rows, bytes per row] when quantised
    rows = 1 if data.ndim == 1 else data.shape[0]
    rows_per_chunk = max(1, _CHUNK_VALUES // max(1, plan.tensor.n_elements // rows))
    is_norm = plan.hf_name.endswith("norm.weight")
    for start in range(0, rows, rows_per_chunk):
        block = data if data.ndim == 1 else data[start : start + rows_per_chunk]
        values = np.asarray(gguf.quants.dequantize(block, plan.tensor.tensor_type), dtype=np.float32)
        yield values - np.float32(1.0) if is_norm else values


def write_safetensors(path: Path, plans: list[TensorPlan], desc: str) -> None:
    """Write float32 tensors in the safetensors format, one chunk at a time.

    Format: u64 little-endian header length, a JSON header (padded to 8 bytes) giving each tensor's
    dtype, shape and byte range, then the raw little-endian data in header order.
    """
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for plan in plans:
        size = 4 * int(np.prod(plan.shape))
        header[plan.hf_name] = {
            "dtype": "F32",
            "shape": list(plan.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)

    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for plan in tqdm(plans, desc=desc, unit="tensor"):
            written = 0
            for chunk in _dequantized_chunks(plan):
                file.write(np.ascontiguousarray(chunk, dtype="<f4").data)
                written += chunk.size
            assert written == int(np.prod(plan.shape)), f"{plan.hf_name}: wrote {written} values"
