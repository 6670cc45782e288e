"""Two real `kvsplice serve` processes pointed at one real redis-server, driven by the official `openai`
client: documents replica A saw first are segment hits on replica B, loaded from Redis."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsplice.bench.server_process import serve
from tests.test_store_support import RedisServer

pytestmark = pytest.mark.slow

DOCS = [
    "Nile: the longest river in Africa, flowing north into the Mediterranean Sea.",
    "Kilimanjaro: a mountain in Tanzania, the highest on the African continent.",
    "Sahara: the largest hot desert in the world, spanning much of North Africa.",
]


def redis_metric(url: str, name: str) -> float:
    """The value of `name` for the Redis tier on a server's /metrics (0 if absent)."""
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("tier") == "redis":
                return sample.value
    return 0.0


def ask(client: openai.OpenAI, docs: list[str]) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Which document mentions a desert?"}],
        max_tokens=2,
        temperature=0,
        extra_body={"documents": docs},
    ).usage


def test_a_document_first_seen_by_replica_a_is_a_segment_hit_on_replica_b(
    tmp_path: Path, default_model_dir: Path
) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    flags = ["--store-url", redis.url, "--kv-cache-gb", "0.25", "--num-threads", "1"]
    try:
        with serve(flags) as url_a, serve(flags) as url_b:
            a = openai.OpenAI(base_url=url_a + "/v1", api_key="unused", max_retries=0, timeout=120)
            b = openai.OpenAI(base_url=url_b + "/v1", api_key="unused", max_retries=0, timeout=120)
            first = ask(a, DOCS)
            assert first.segment_hit_tokens == 0 and first.store_hit_tokens == 0
            # Write-through is asynchronous, and a segment is written once its three extra contexts are
            # computed (about 1,000 tokens each while the store holds few other documents): wait until
            # A's three documents are in Redis.
            deadline = time.monotonic() + 180
            while redis_metric(url_a, "kvsplice:store_writes_total") < len(DOCS):
                assert time.monotonic() < deadline, "replica A did not write its documents through"
                time.sleep(0.2)
            second = ask(b, [DOCS[2], DOCS[0], DOCS[1]])
            assert second.segment_hit_tokens > 0
            assert 0 < second.store_hit_tokens <= second.segment_hit_tokens + second.prefix_hit_tokens
            assert redis_metric(url_b, "kvsplice:store_hits_total") == len(DOCS)
            assert redis_metric(url_b, "kvsplice:store_corrupt_entries_total") == 0
    finally:
        redis.kill()
