"""GGUF conversion: against transformers' own GGUF loading on the default model, and on tiny GGUFs
written here for the cache, atomicity and error paths, and for llama's q/k permutation and
byte-level BPE vocabulary (SmolLM2 itself: test_smollm2.py)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

import kvsplice.loader.gguf as gguf_loader
import kvsplice.loader.gguf_weights as gguf_weights
from kvsplice.errors import ModelLoadError
from kvsplice.loader.gguf import CONVERTED_FILES, MARKER_FILE, convert_gguf
from kvsplice.loader.gguf_config import gemma3_config
from kvsplice.loader.gguf_file import read_gguf
from kvsplice.loader.gguf_tokenizer import GgufVocab
from kvsplice.loader.gguf_weights import hf_tensor_name
from kvsplice.loader.tokenizer import Tokenizer

# ------------------------------------------------------------------------------------- tiny GGUFs

TINY_TOKENS = [
    "<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "\n", "  ",
    *(f"<0x{byte:02X}>" for byte in range(256)),
    "▁", "a", "b", "ab", "▁a", "▁ab",
]  # fmt: skip
TINY_TYPES = [3] * 7 + [4, 4] + [6] * 256 + [1] * 6
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 8, 2, 2, 1, 4, 16


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face names -> float32 weights in HF layout, norms as the model uses them (w, not 1 + w)."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (len(TINY_TOKENS), HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            f"{layer}.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            f"{layer}.self_attn.q_norm.weight": (HEAD_DIM,),
            f"{layer}.self_attn.k_norm.weight": (HEAD_DIM,),
            f"{layer}.input_layernorm.weight": (HIDDEN,),
            f"{layer}.post_attention_layernorm.weight": (HIDDEN,),
            f"{layer}.pre_feedforward_layernorm.weight": (HIDDEN,),
            f"{layer}.post_feedforward_layernorm.weight": (HIDDEN,),
            f"{layer}.mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.up_proj.weight": (FFN, HIDDEN),
            f"{layer}.mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def gguf_name(hf_name: str) -> str:
    renames = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    renames |= {f"model.layers.{i}.": f"blk.{i}." for i in range(LAYERS)}
    renames |= {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for old, new in renames.items():
        hf_name = hf_name.replace(old, new)
    return hf_name


def write_tiny_gguf(
    path: Path,
    arch: str = "gemma3",
    seed: int = 0,
    endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE,
    add_space_prefix: bool = False,
) -> Path:
    """A gemma3 GGUF as llama.cpp writes one: HF-layout arrays under GGUF names, norms stored as 1 + w."""
    writer = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_sliding_window(16)
    writer.add_tokenizer_model("llama")
    writer.add_add_space_prefix(add_space_prefix)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_scores([0.0] * len(TINY_TOKENS))
    writer.add_token_types(TINY_TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    for name, weight in tiny_weights(seed).items():
        writer.add_tensor(gguf_name(name), weight + 1 if name.endswith("norm.weight") else weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


def test_tiny_conversion_writes_hf_names_layouts_and_norms(tiny_gguf: Path, tmp_path: Path) -> None:
    out = convert_gguf(tiny_gguf, tmp_path / "cache")
    assert all((out / name).is_file() for name in CONVERTED_FILES)
    expected = tiny_weights()
    with safe_open(str(out / "model.safetensors"), "pt") as converted:
        assert set(converted.keys()) == set(expected)
        for name, weight in expected.items():
            torch.testing.assert_close(
                converted.get_tensor(name), torch.from_numpy(weight), rtol=0, atol=1e-6
            )

    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "sliding_attention"]
    assert config["head_dim"] == config["query_pre_attn_scalar"] == HEAD_DIM
    assert config["vocab_size"] == len(TINY_TOKENS)
    assert config["tie_word_embeddings"] is True
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer.eos_token_ids == {1, 6}  # <eos> and <end_of_turn>
    assert tokenizer.encode("<start_of_turn>a ab\n") == [5, 266, 270, 7]


def test_second_call_reuses_the_conversion_without_rewriting(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = convert_gguf(tiny_gguf, tmp_path / "cache")
    stamps = {name: (first / name).stat().st_mtime_ns for name in CONVERTED_FILES}

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_loader, "_convert_into", no_conversion)
    start = time.perf_counter()
    assert convert_gguf(tiny_gguf, tmp_path / "cache") == first
    assert time.perf_counter() - start < 0.5
    assert {name: (first / name).stat().st_mtime_ns for name in CONVERTED_FILES} == stamps

    # Keyed by content: a copy elsewhere maps to the same directory.
    copy = tmp_path / "elsewhere" / "copy.gguf"
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)
    assert convert_gguf(copy, tmp_path / "cache") == first


def test_an_unchanged_file_is_not_hashed_again_but_a_changed_one_is(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = convert_gguf(tiny_gguf, tmp_path / "cache")
    real_digest = gguf_loader.hashlib.file_digest

    def no_hashing(*args: object, **kwargs: object) -> None:
        raise AssertionError("hashed again")

    monkeypatch.setattr(gguf_loader.hashlib, "file_digest", no_hashing)
    assert convert_gguf(tiny_gguf, tmp_path / "cache") == first

    monkeypatch.setattr(gguf_loader.hashlib, "file_digest", real_digest)
    write_tiny_gguf(tiny_gguf, seed=1)  # new content (and size/mtime) at the same path
    second = convert_gguf(tiny_gguf, tmp_path / "cache")
    assert second != first
    with safe_open(str(second / "model.safetensors"), "pt") as converted:
        embedding = converted.get_tensor("model.embed_tokens.weight")
    torch.testing.assert_close(embedding, torch.from_numpy(tiny_weights(seed=1)["model.embed_tokens.weight"]))


def test_an_interrupted_conversion_leaves_nothing_that_looks_complete(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "write_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, tmp_path / "cache")
    assert [entry.name for entry in (tmp_path / "cache").iterdir()] == ["sha256-index.json"]


def test_leftovers_of_a_killed_conversion_are_ignored_and_removed(tiny_gguf: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    key = convert_gguf(tiny_gguf, cache).name
    shutil.rmtree(cache / key)
    # A killed process's temp dir (pid above Linux's pid_max, so surely dead), and a final-named
    # directory without the completion marker.
    abandoned = cache / f"{key}.tmp-4194999-abc"
    abandoned.mkdir()
    (abandoned / "config.json").write_text("{}")
    half = cache / key
    half.mkdir()
    (half / "config.json").write_text("{}")
    live = cache / f"{key}.tmp-{os.getpid()}-live"  # a conversion still running: left alone
    live.mkdir()

    out = convert_gguf(tiny_gguf, cache)
    assert out == half and all((out / name).is_file() for name in CONVERTED_FILES)
    assert not abandoned.exists()
    assert live.exists()


def test_a_conversion_by_an_older_converter_is_rebuilt(tiny_gguf: Path, tmp_path: Path) -> None:
    out = convert_gguf(tiny_gguf, tmp_path / "cache")
    marker = json.loads((out / MARKER_FILE).read_text())
    (out / MARKER_FILE).write_text(json.dumps(marker | {"version": marker["version"] - 1}))
    (out / "config.json").write_text("{}")
    assert convert_gguf(tiny_gguf, tmp_path / "cache") == out
    assert json.loads((out / "config.json").read_text())["model_type"] == "gemma3_text"


def test_cache_root_comes_from_kvsplice_cache(tiny_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVSPLICE_CACHE", str(tmp_path / "kv"))
    assert convert_gguf(tiny_gguf).parent == tmp_path / "kv" / "gguf"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "cache")


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        convert_gguf(path, tmp_path / "cache")


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_header_reader_matches_gguf_py(tmp_path: Path, endianess: gguf.GGUFEndian) -> None:
    """read_gguf against gguf-py's own (much slower) GGUFReader: the same values and tensor data."""
    path = write_tiny_gguf(tmp_path / "tiny.gguf", endianess=endianess)
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    expected = {
        name: field.contents() for name, field in theirs.fields.items() if not name.startswith("GGUF.")
    }
    assert ours.metadata == expected
    assert [type(value) for value in ours.metadata["tokenizer.ggml.scores"]] == [float] * len(TINY_TOKENS)
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_elements) == (
            reference.name,
            reference.tensor_type,
            reference.n_elements,
        )
        assert mine.shape == tuple(int(dim) for dim in reference.shape)
        assert mine.data.dtype == reference.data.dtype
        np.testing.assert_array_equal(mine.data, reference.data)


def test_truncated_gguf(tiny_gguf: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="cannot parse GGUF"):
        convert_gguf(truncated, tmp_path / "cache")


def test_corrupt_block_count_is_refused_before_building_per_layer_tables(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.gguf"
    data = bytearray(write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes())
    key = b"gemma3.block_count"
    at = data.index(key) + len(key) + 4  # then the value type (uint32), then the value
    data[at : at + 4] = (14_000_000).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="block_count"):
        convert_gguf(path, tmp_path / "cache")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "qwen2.gguf", arch="qwen2")
    with pytest.raises(ModelLoadError, match=r"'qwen2' model; kvsplice converts the 'gemma3', 'llama' arch"):
        convert_gguf(path, tmp_path / "cache")
    assert not any(entry.is_dir() for entry in (tmp_path / "cache").iterdir())


def test_sentencepiece_that_prepends_a_space_is_refused(tmp_path: Path) -> None:
    """Llama 2 style vocabularies tokenise " " + text; the SentencePiece rebuild here is Gemma's."""
    path = write_tiny_gguf(tmp_path / "spm.gguf", add_space_prefix=True)
    with pytest.raises(ModelLoadError, match="prepends a space"):
        convert_gguf(path, tmp_path / "cache")


def test_config_follows_optional_gemma3_metadata() -> None:
    """Keys newer or larger Gemma 3 GGUFs carry: SWA rope base and pattern, linear rope scaling."""
    vocab = GgufVocab(
        model="llama", pre=None, tokens=["<pad>"], token_types=[3], merges=[], bos_id=None, eos_id=None,
        pad_id=0, unk_id=None, add_bos=True, add_eos=False, chat_template=None,
    )  # fmt: skip
    metadata = {
        "gemma3.block_count": 4, "gemma3.embedding_length": 8, "gemma3.feed_forward_length": 16,
        "gemma3.attention.head_count": 2, "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 4, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
        "gemma3.context_length": 64, "gemma3.attention.sliding_window": 8, "gemma3.rope.freq_base": 1e6,
        "gemma3.rope.freq_base_swa": 500.0, "gemma3.attention.sliding_window_pattern": 2,
        "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
    }  # fmt: skip
    config = gemma3_config(metadata, vocab, tied=True)
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    }
    with pytest.raises(ModelLoadError, match="rope scaling 'yarn'"):
        gemma3_config(metadata | {"gemma3.rope.scaling.type": "yarn"}, vocab, tied=True)
    with pytest.raises(ModelLoadError, match=r"gemma3\.context_length"):
        gemma3_config({k: v for k, v in metadata.items() if k != "gemma3.context_length"}, vocab, tied=True)


# ------------------------------------------------------------------------------- tiny llama GGUFs


def gpt2_byte_spelling() -> dict[int, str]:
    """GPT-2's printable spelling of bytes: printable Latin-1 bytes stand for themselves, the others
    take the characters from U+0100 on, in byte order (so a space is "Ġ", a newline "Ċ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    spelling = {byte: chr(byte) for byte in [*printable, *range(ord("®"), ord("ÿ") + 1)]}
    for extra, byte in enumerate(byte for byte in range(256) if byte not in spelling):
        spelling[byte] = chr(256 + extra)
    return spelling


LLAMA_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA_MERGES = ["Ġ a", "a b", "Ġa b", "Ġ Ġ"]
LLAMA_TOKENS = [*LLAMA_SPECIALS, *gpt2_byte_spelling().values(), "Ġa", "ab", "Ġab", "ĠĠ"]
L_HIDDEN, L_LAYERS, L_HEADS, L_KV_HEADS, L_HEAD_DIM, L_FFN = 32, 2, 2, 1, 16, 64


def tiny_llama_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face Llama names -> float32 weights in HF layout."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (len(LLAMA_TOKENS), L_HIDDEN), "model.norm.weight": (L_HIDDEN,)}
    for i in range(L_LAYERS):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (L_HEADS * L_HEAD_DIM, L_HIDDEN),
            f"{layer}.self_attn.k_proj.weight": (L_KV_HEADS * L_HEAD_DIM, L_HIDDEN),
            f"{layer}.self_attn.v_proj.weight": (L_KV_HEADS * L_HEAD_DIM, L_HIDDEN),
            f"{layer}.self_attn.o_proj.weight": (L_HIDDEN, L_HEADS * L_HEAD_DIM),
            f"{layer}.input_layernorm.weight": (L_HIDDEN,),
            f"{layer}.post_attention_layernorm.weight": (L_HIDDEN,),
            f"{layer}.mlp.gate_proj.weight": (L_FFN, L_HIDDEN),
            f"{layer}.mlp.up_proj.weight": (L_FFN, L_HIDDEN),
            f"{layer}.mlp.down_proj.weight": (L_HIDDEN, L_FFN),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def llama_cpp_rope_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q_proj / k_proj: within each head, row i of the
    first half and row i of the second half become rows 2i and 2i + 1."""
    rows = weight.shape[0]
    halves = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])  # [heads, half, i, in]
    return halves.swapaxes(1, 2).reshape(weight.shape)


def llama_gguf_name(hf_name: str) -> str:
    renames = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    renames |= {f"model.layers.{i}.": f"blk.{i}." for i in range(L_LAYERS)}
    renames |= {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for old, new in renames.items():
        hf_name = hf_name.replace(old, new)
    return hf_name


def write_tiny_llama_gguf(path: Path, pre: str = "smollm", down_type: str = "F32") -> Path:
    """A llama GGUF with a byte-level BPE vocabulary, as llama.cpp writes SmolLM2: q/k rows permuted.
    `down_type` stores every ffn_down in another ggml type (bytes of zeros; for the error path)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(L_HIDDEN)
    writer.add_block_count(L_LAYERS)
    writer.add_feed_forward_length(L_FFN)
    writer.add_head_count(L_HEADS)
    writer.add_head_count_kv(L_KV_HEADS)
    writer.add_rope_dimension_count(L_HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(1e5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(LLAMA_TOKENS)
    writer.add_token_types([3] * len(LLAMA_SPECIALS) + [1] * (len(LLAMA_TOKENS) - len(LLAMA_SPECIALS)))
    writer.add_token_merges(LLAMA_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, weight in tiny_llama_weights().items():
        if name.endswith("q_proj.weight"):
            weight = llama_cpp_rope_permute(weight, L_HEADS)
        elif name.endswith("k_proj.weight"):
            weight = llama_cpp_rope_permute(weight, L_KV_HEADS)
        elif name.endswith("down_proj.weight") and down_type != "F32":
            ggml_type = gguf.GGMLQuantizationType[down_type]
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
            weight = np.zeros((L_HIDDEN, L_FFN // block_values * block_bytes), np.uint8)
            writer.add_tensor(llama_gguf_name(name), weight, raw_dtype=ggml_type)  # shape from the bytes
            continue
        writer.add_tensor(llama_gguf_name(name), weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("chunk_values", [1 << 23, 3 * L_HIDDEN])
def test_tiny_llama_conversion_undoes_the_rope_permutation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_values: int
) -> None:
    """Names, layouts and q/k rows back as transformers has them, also when q/k are written in
    several chunks (3 rows' worth: chunks are rounded to whole heads)."""
    monkeypatch.setattr(gguf_weights, "_CHUNK_VALUES", chunk_values)
    out = convert_gguf(write_tiny_llama_gguf(tmp_path / "llama.gguf"), tmp_path / "cache")
    expected = tiny_llama_weights()
    with safe_open(str(out / "model.safetensors"), "pt") as converted:
        assert set(converted.keys()) == set(expected)
        for name, weight in expected.items():
            assert torch.equal(converted.get_tensor(name), torch.from_numpy(weight)), name

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (2, 1, 16)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e5}
    assert config["rms_norm_eps"] == 1e-5 and config["tie_word_embeddings"] is True


def test_tiny_llama_byte_level_tokenizer(tmp_path: Path) -> None:
    out = convert_gguf(write_tiny_llama_gguf(tmp_path / "llama.gguf"), tmp_path / "cache")
    tokenizer = Tokenizer.from_dir(out)
    ids = {token: index for index, token in enumerate(LLAMA_TOKENS)}
    assert not tokenizer.add_bos and tokenizer.eos_token_ids == {2}
    # Merges apply within words; each digit stands alone, so the spaces before one stay one run (as
    # llama.cpp's "smollm" pre-tokenizer splits: digits first, then GPT-2's regex).
    text = "<|im_start|>ab ab  1é"
    expected = ["<|im_start|>", "ab", "Ġab", "ĠĠ", "1", *(gpt2_byte_spelling()[b] for b in "é".encode())]
    assert tokenizer.encode(text) == [ids[token] for token in expected]
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"


def test_byte_level_pre_tokenizer_not_known_is_refused(tmp_path: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "llama.gguf", pre="llama-bpe")
    with pytest.raises(ModelLoadError, match=r"pre-tokenizer 'llama-bpe' is not supported; .* 'smollm'"):
        convert_gguf(path, tmp_path / "cache")


def test_a_ggml_type_gguf_py_cannot_dequantise_is_refused_before_writing(tmp_path: Path) -> None:
    path = write_tiny_llama_gguf(tmp_path / "llama.gguf", down_type="Q8_1")
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_down\.weight is stored as Q8_1, a ggml type"):
        convert_gguf(path, tmp_path / "cache")
    assert not any(entry.is_dir() for entry in (tmp_path / "cache").iterdir())


def test_a_ggml_type_unknown_to_gguf_py_is_a_parse_error(tmp_path: Path) -> None:
    data = bytearray(write_tiny_llama_gguf(tmp_path / "llama.gguf").read_bytes())
    name = b"blk.1.ffn_down.weight"
    at = data.index(name) + len(name) + 4 + 2 * 8  # then u32 n_dims, two u64 dims, the u32 type
    assert int.from_bytes(data[at : at + 4], "little") == gguf.GGMLQuantizationType.F32
    data[at : at + 4] = (999).to_bytes(4, "little")
    path = tmp_path / "unknown-type.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_down\.weight' has ggml type 999, unknown"):
        convert_gguf(path, tmp_path / "cache")


# ---------------------------------------------------------------------- the default model vs transformers


@pytest.fixture(scope="module")
def reference_config(default_gguf_path: Path):
    """transformers' own config for the GGUF (~17 s: its GGUF reader parses the whole vocabulary)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(default_gguf_path.parent, gguf_file=default_gguf_path.name)


def test_config_matches_transformers_gguf_path(default_model_dir: Path, reference_config) -> None:
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(default_model_dir)
    assert ours.architectures == ["Gemma3ForCausalLM"]
    for field in (
        "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
        "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar", "hidden_activation",
        "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
        "attn_logit_softcapping", "final_logit_softcapping",
    ):  # fmt: skip
        assert getattr(ours, field) == getattr(reference_config, field), field
    # The GGUF holds 1e-6 as float32; we write the decimal it came from.
    assert ours.rms_norm_eps == pytest.approx(reference_config.rms_norm_eps, rel=1e-7)
    assert ours.rms_norm_eps == 1e-6


def test_weights_equal_transformers_gguf_loading(
    default_gguf_path: Path, default_model_dir: Path, reference_config
):
    """Every tensor, after transformers' own name mapping, dequantisation and Gemma norm fix (~25 s)."""
    from transformers import Gemma3ForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = Gemma3ForCausalLM(reference_config)  # only its parameter names are used
    loaded = load_gguf_checkpoint(str(default_gguf_path), return_tensors=True, model_to_load=skeleton)
    reference = loaded["tensors"]
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as converted:
        assert set(converted.keys()) == set(reference)
        for name in converted.keys():  # noqa: SIM118 (safe_open is not a mapping)
            ours = converted.get_tensor(name)
            assert ours.dtype == torch.float32, name
            assert torch.equal(ours, reference[name]), name


def _q5_0_oracle(blocks: np.ndarray) -> np.ndarray:
    """ggml's Q5_0, straight from its block layout: f16 scale, 32 high bits, 16 bytes of low nibbles."""
    blocks = blocks.reshape(-1, 22)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    high = blocks[:, 2:6].copy().view("<u4")  # [n, 1]
    low = blocks[:, 6:].astype(np.uint32)  # [n, 16]
    j = np.arange(16, dtype=np.uint32)
    first = (low & 0xF) | (((high >> j) & 1) << 4)
    second = (low >> 4) | (((high >> (j + 16)) & 1) << 4)
    return (np.concatenate([first, second], axis=1).astype(np.float32) - 16) * scale


def test_dequantisation_matches_independent_implementations(default_gguf_path: Path, default_model_dir: Path):
    """gguf-py dequantised both sides above; check one tensor of every quant type in the file against
    transformers' torch kernels (Q8_0, Q4_K, Q6_K) and a numpy oracle (Q5_0, which they lack)."""
    from transformers.integrations.gguf import dequant
    from transformers.integrations.gguf import reader as hf_reader

    # transformers' public reader refuses Q5_0 files, so walk the tensor table with its helpers.
    blob = hf_reader._mapped(str(default_gguf_path))
    _, tensor_count, position = hf_reader._read_metadata(blob, str(default_gguf_path))
    table, position = hf_reader._read_tensor_table(blob, tensor_count, position)
    data_start = -(-position // 32) * 32  # aligned to general.alignment, which defaults to 32
    first_of_type = {}
    for name, shape, ggml_type, offset in table:
        first_of_type.setdefault(ggml_type, (name, shape, offset))
    types_in_file = {gguf.GGMLQuantizationType(t).name for t in first_of_type}
    assert types_in_file == {"F32", "Q8_0", "Q4_K", "Q5_0", "Q6_K"}

    rows_checked = 512
    with safe_open(str(default_model_dir / "model.safetensors"), "pt") as converted:
        for ggml_type, (name, shape, offset) in first_of_type.items():
            if ggml_type == gguf.GGMLQuantizationType.F32:
                continue
            block_values, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
            rows, columns = min(rows_checked, shape[0]), shape[1]  # a few whole rows are enough, and fast
            start = data_start + offset
            blocks = np.array(blob[start : start + rows * columns // block_values * block_bytes])
            if ggml_type == gguf.GGMLQuantizationType.Q5_0:
                expected = torch.from_numpy(_q5_0_oracle(blocks))
            else:
                expected = dequant.dequantize(torch.from_numpy(blocks), ggml_type)
            ours = converted.get_slice(hf_tensor_name(name, "gemma3"))[:rows]
            torch.testing.assert_close(ours, expected.reshape(rows, columns), rtol=1e-6, atol=1e-7, msg=name)


def test_transformers_loads_the_converted_directory(default_model_dir: Path) -> None:
    from transformers import Gemma3ForCausalLM

    model, info = Gemma3ForCausalLM.from_pretrained(default_model_dir, output_loading_info=True)
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
