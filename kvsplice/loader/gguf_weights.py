"""A GGUF's tensors, named, checked and dequantised into model.safetensors (float32, Hugging Face names).

GGUF tensor names are mapped to the Hugging Face names of the file's architecture, and every
tensor's shape and type is checked against the config before anything is written. The weights are
then written a chunk at a time, with what llama.cpp's converter did to them undone:
- gemma3: RMSNorm weights are stored as 1 + w (Gemma's norm multiplies by 1 + w); transformers wants w.
- llama: the rows of q_proj and k_proj are permuted within each head, because llama.cpp's RoPE
  rotates adjacent pairs (2i, 2i + 1) where transformers' rotates (i, i + head_dim / 2).
"""

from __future__ import annotations

import functools
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

# Dequantise this many values at a time, so the 262144 x 640 embedding never exists twice in memory.
_CHUNK_VALUES = 1 << 23

# GGUF tensor names -> Hugging Face names; per-layer ones live under model.layers.{i}.
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # only in files whose output is not tied to the embedding
}
_LAYER_TENSORS = {
    "gemma3": {
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
    },
    "llama": {
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",  # llama's norm before the MLP, named as transformers does
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


class TensorPlan(NamedTuple):
    """One GGUF tensor, where it goes in model.safetensors, and how llama.cpp stored it."""

    tensor: GgufTensor
    hf_name: str
    shape: tuple[int, ...]  # Hugging Face order: [out_features, in_features] for a linear weight
    plus_one: bool  # stored as 1 + w (Gemma's RMSNorm weights)
    rope_heads: int  # rows interleaved per head for llama.cpp's RoPE, over this many heads; 0: not


def plan_tensors(
    tensors: list[GgufTensor], config: dict[str, Any], architecture: str, path: Path
) -> list[TensorPlan]:
    """Name and check every tensor before writing anything: unknown, missing or misshapen ones fail,
    and so do ones in a ggml type that cannot be dequantised."""
    expected = _expected_shapes(config, architecture)
    plans = []
    for tensor in tensors:
        hf_name = hf_tensor_name(tensor.name, architecture)
        if hf_name is None or hf_name not in expected:
            # llama.cpp stores llama3-style rope scaling as this tensor of per-frequency factors.
            why = " (llama3 rope scaling, not supported)" if tensor.name == "rope_freqs.weight" else ""
            raise ModelLoadError(f"{path}: unexpected tensor {tensor.name!r}{why} for a {architecture} model")
        shape = tuple(int(dim) for dim in reversed(tensor.shape))  # ggml lists the fastest axis first
        if shape != expected[hf_name]:
            raise ModelLoadError(f"{path}: {tensor.name} has shape {shape}, expected {expected[hf_name]}")
        if not _can_dequantize(tensor.tensor_type):
            raise ModelLoadError(
                f"{path}: {tensor.name} is stored as {tensor.tensor_type.name}, a ggml type that the "
                "installed gguf package cannot dequantise"
            )
        plans.append(TensorPlan(tensor, hf_name, shape, *_stored_form(hf_name, config, architecture)))
    missing = sorted(set(expected) - {plan.hf_name for plan in plans})
    if missing:
        raise ModelLoadError(f"{path}: tensors missing for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return plans


def _stored_form(hf_name: str, config: dict[str, Any], architecture: str) -> tuple[bool, int]:
    """(plus_one, rope_heads) of a tensor: what llama.cpp's converter changed in it."""
    if architecture == "gemma3":
        return hf_name.endswith("norm.weight"), 0
    # Llama: llama.cpp permutes q with the query heads, k with the key/value heads.
    if hf_name.endswith("self_attn.q_proj.weight"):
        return False, config["num_attention_heads"]
    if hf_name.endswith("self_attn.k_proj.weight"):
        return False, config["num_key_value_heads"]
    return False, 0


@functools.cache
def _can_dequantize(tensor_type: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf-py dequantises this type: it raises NotImplementedError for the ones it cannot."""
    block_bytes = gguf.GGML_QUANT_SIZES[tensor_type][1]
    try:
        gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8), tensor_type)
    except NotImplementedError:
        return False
    return True


def hf_tensor_name(gguf_name: str, architecture: str) -> str | None:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    layer_tensors = _LAYER_TENSORS[architecture]
    if match is None or match[2] not in layer_tensors:
        return None
    return f"model.layers.{match[1]}.{layer_tensors[match[2]]}.weight"


def _expected_shapes(config: dict[str, Any], architecture: str) -> dict[str, tuple[int, ...]]:
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    shape_of = {
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
    per_layer = {name: shape_of[name] for name in _LAYER_TENSORS[architecture].values()}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for layer in range(config["num_hidden_layers"]):
        for name, shape in per_layer.items():
            shapes[f"model.layers.{layer}.{name}.weight"] = shape
    return shapes


def _dequantized_chunks(plan: TensorPlan) -> Iterator[np.ndarray]:
    """The tensor as float32 in row chunks, Hugging Face layout, with llama.cpp's changes undone."""
    data = plan.tensor.data  # HF order: [rows, values per row], or [rows, bytes per row] when quantised
    rows = 1 if data.ndim == 1 else data.shape[0]
    rows_per_chunk = max(1, _CHUNK_VALUES // max(1, plan.tensor.n_elements // rows))
    head_rows = rows // plan.rope_heads if plan.rope_heads else 1
    rows_per_chunk = max(1, rows_per_chunk // head_rows) * head_rows  # whole heads: they are unpermuted alone
    for start in range(0, rows, rows_per_chunk):
        block = data if data.ndim == 1 else data[start : start + rows_per_chunk]
        values = np.asarray(gguf.quants.dequantize(block, plan.tensor.tensor_type), dtype=np.float32)
        if plan.plus_one:
            values = values - np.float32(1.0)
        if plan.rope_heads:
            values = _unpermute_rope_rows(values, head_rows)
        yield values


def _unpermute_rope_rows(values: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a q/k projection: [heads * head_dim, in] -> the same shape.

    Within a head, transformers' rows i and i + head_dim/2 form a rotated pair; llama.cpp's converter
    moves them to rows 2i and 2i + 1.
    """
    rows, columns = values.shape
    assert rows % head_dim == 0 and head_dim % 2 == 0, (rows, head_dim)
    # [heads, head_dim/2 (i), 2 (which half), in] -> [heads, 2, head_dim/2, in]
    pairs = values.reshape(rows // head_dim, head_dim // 2, 2, columns)
    return pairs.swapaxes(1, 2).reshape(rows, columns)


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
