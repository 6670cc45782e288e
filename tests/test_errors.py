"""A user's mistake gets a clear exception (the CLI: one line and a non-zero exit), never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsplice import LLM, InvalidRequestError, ModelLoadError, PromptTooLongError, SamplingParams, Segment
from kvsplice.errors import ConfigError
from tests import tiny_models


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    directory = tmp_path_factory.mktemp("tiny")
    tiny_models.save("LlamaForCausalLM", directory)
    return LLM(model=str(directory), max_model_len=64, kv_cache_gb=0.01)


def test_missing_model_path() -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(model="/nonexistent/model")


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"]}')
    with pytest.raises(ModelLoadError, match="not supported"):
        LLM(model=str(tmp_path))


def test_not_a_model_file(tmp_path: Path) -> None:
    bogus = tmp_path / "weights.bin"
    bogus.write_bytes(b"nothing")
    with pytest.raises(ModelLoadError, match="neither"):
        LLM(model=str(bogus))


@pytest.mark.parametrize(
    "settings",
    [
        {"prefix_cache": "lru"},
        {"repair": "magic"},
        {"recompute_ratio": 1.5},
        {"store": {"store_dir": ""}},
        {"repair_fallback_margin": 1.5},
        {"block_size": 0},
        {"kv_cache_gb": -1},
    ],
)
def test_invalid_engine_settings(settings: dict) -> None:
    with pytest.raises(ConfigError):
        LLM(model="/unused", **settings)


def test_prompt_longer_than_context(tiny_llm: LLM) -> None:
    with pytest.raises(PromptTooLongError, match="context"):
        tiny_llm.generate([list(range(1, 100))])


@pytest.mark.parametrize("prompt", ["", [], [[]], [Segment("x"), 3.5]])
def test_empty_or_malformed_prompt(tiny_llm: LLM, prompt) -> None:
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate(prompt)


def test_text_prompt_without_tokenizer(tiny_llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        tiny_llm.generate("hello")


def test_out_of_vocabulary_token(tiny_llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        tiny_llm.generate([[1, 2, 10**6]])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -2},
        {"max_tokens": 0},
        {"max_tokens": 2.5},
        {"stop": [""]},
    ],
)
def test_invalid_sampling_values(kwargs: dict) -> None:
    with pytest.raises(InvalidRequestError, match="invalid sampling"):
        SamplingParams(**kwargs)


def test_a_bad_prompt_in_a_batch_loses_nothing(tiny_llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        tiny_llm.generate([[1, 2, 3], []])
    assert not tiny_llm.engine.has_unfinished()
    out = tiny_llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--model", "/nonexistent"], "does not exist"),
        (["generate", "hi", "--model", "/nonexistent", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--prefix-cache", "bogus"], "prefix_cache"),
    ],
)
def test_cli_errors_are_one_line(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvsplice.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvsplice: error:") and message in lines[0], proc.stderr
