"""What a process owes the tiers below the pool reaches them however it ends: a script that never calls
close(), a `with` block, a server stopped with SIGTERM. A second process then finds the segments of a
reordered prompt there, on disk and in Redis. Tiny models (tests/tiny_models.py), real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvsplice import LLM, SamplingParams, Segment
from kvsplice.bench.server_process import serve
from tests import tiny_models
from tests.test_store_support import RedisServer, segment_files

SYSTEM = [11, 12, 13]
DOCS = [[20 + 7 * d + i % 5 for i in range(60)] for d in range(4)]
QUESTION = [9, 8, 7]
ONE = SamplingParams(max_tokens=1, temperature=0.0)
# Small pool, one thread: the child processes start in a second or two.
SETTINGS = {"block_size": 8, "kv_cache_gb": 0.01, "num_threads": 1, "prefix_cache": "off"}

# A script that generates once and ends without close(): what an offline user writes.
SCRIPT = """
import json, sys
from kvsplice import LLM, SamplingParams, Segment
model, store, settings, system, docs, question = json.loads(sys.argv[1])
llm = LLM(model=model, store=store, **settings)
llm.generate([[system, *(Segment(d) for d in docs), question]], SamplingParams(max_tokens=1, temperature=0.0))
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("LlamaForCausalLM")
    tiny_models.save("LlamaForCausalLM", directory)
    return directory


def _script(model_dir: Path, store: dict[str, str]) -> None:
    args = json.dumps([str(model_dir), store, SETTINGS, SYSTEM, DOCS, QUESTION])
    subprocess.run([sys.executable, "-c", SCRIPT, args], check=True, timeout=120)


def _reordered(model_dir: Path, store: dict[str, str], tier: str) -> float:
    """The share of a reordered prompt a fresh engine loads from `tier`."""
    llm = LLM(model=str(model_dir), store=store, **SETTINGS)
    out = llm.generate([[SYSTEM, *(Segment(d) for d in reversed(DOCS)), QUESTION]], ONE)[0]
    llm.close()
    return out.metrics.store_hit_tokens.get(tier, 0) / out.metrics.prompt_tokens


def test_a_script_that_never_closes_leaves_its_segments_on_disk(model_dir: Path, tmp_path: Path) -> None:
    store = {"store_dir": str(tmp_path / "store")}
    _script(model_dir, store)
    assert _reordered(model_dir, store, "disk") >= 0.8


def test_a_script_that_never_closes_shares_its_segments_through_redis(
    model_dir: Path, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        store = {"store_url": server.url}
        _script(model_dir, store)
        assert _reordered(model_dir, store, "redis") >= 0.8
    finally:
        server.kill()


def test_a_with_block_writes_what_it_owes(model_dir: Path, tmp_path: Path) -> None:
    store = {"store_dir": str(tmp_path / "store")}
    with LLM(model=str(model_dir), store=store, **SETTINGS) as llm:
        llm.generate([[SYSTEM, *(Segment(d) for d in DOCS), QUESTION]], ONE)
        # The copies into the store wait for the engine's next steps: nothing is on disk yet.
        assert llm.engine.stats().background_queued > 0
    assert len(segment_files(tmp_path / "store")) == len(DOCS)
    llm.close()  # again: nothing more
    assert _reordered(model_dir, store, "disk") >= 0.8


@pytest.mark.slow
def test_a_server_stopped_with_sigterm_writes_what_it_owes(model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    flags = [
        "--model",
        str(model_dir),
        "--store-dir",
        str(store),
        "--num-threads",
        "1",
        "--kv-cache-gb",
        "0.01",
    ]
    with serve(flags) as url:
        prompt = [{"token_ids": SYSTEM}, *({"segment": d} for d in DOCS), {"token_ids": QUESTION}]
        reply = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert reply.status_code == 200
    # serve() sent SIGTERM: the server shut down and wrote every segment before it exited.
    assert len(segment_files(store)) == len(DOCS)
    assert _reordered(model_dir, {"store_dir": str(store)}, "disk") >= 0.8
