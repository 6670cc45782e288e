"""What the server tests share: the engine behind a running server, its /metrics, waiting until idle.
The server itself (one for the session, the default model) is the `server` fixture in conftest.py."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvsplice.engine.engine import Engine
from kvsplice.server.launch import ServerThread


def engine_of(server: ServerThread) -> Engine:
    return server.app.state.server.engine.engine


def metrics(server: ServerThread) -> dict[str, float]:
    """Every sample of /metrics by name (labels dropped: one model, one series per name here)."""
    text = httpx.get(server.url + "/metrics").text
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (
                "{"
                + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
                + "}"
                if len(sample.labels) > 1
                else ""
            )
            samples[key] = sample.value
    return samples


def wait_idle(server: ServerThread, timeout_s: float = 60) -> dict[str, float]:
    """/metrics once no request runs or waits, no block is held by a request and the store's background
    work is done (it takes and gives back blocks)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        if (
            m["vllm:num_requests_running"]
            == m["vllm:num_requests_waiting"]
            == m["kvsplice:background_jobs_queued"]
            == 0
        ):
            assert m["kvsplice:kv_cache_request_blocks"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
            return m
        assert time.monotonic() < deadline, f"engine not idle: {m}"
        time.sleep(0.1)
