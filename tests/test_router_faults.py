"""Two real `kvsplice serve` replicas sharing one real redis-server behind the real vllm-router, on
loopback, under faults: Redis killed and restarted, a replica killed, a corrupted Redis entry. Every
answer's greedy tokens are compared with a full prefill of the same request on a replica without any
store (the reference); requests whose replica is killed must be retried by the router or fail with a
clear error, and every other request must complete. Each test prints its counts."""

from __future__ import annotations

import contextlib
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsplice.bench.server_process import Served, serve_process
from kvsplice.bench.traffic_report import parse_metrics
from kvsplice.deploy import Deployment, deploy
from tests.test_store_support import RedisServer

pytestmark = pytest.mark.slow

# The defaults, trust gate included: its calibration audits run beside the faults and its record goes
# through the same Redis. Which requests fall back depends on when the replicas merge their samples,
# but a fallback is a full prefill, and the questions are ones a splice answers as one (`workload`).
FLAGS = ["--kv-cache-gb", "0.25", "--num-threads", "1"]
TOPICS = ["river", "mountain", "desert", "forest", "glacier", "volcano", "canyon", "lagoon"]
# About 120 tokens each: the passages are most of a prompt, as in RAG.
DOCS = [
    f"Document about the {t}: "
    + " ".join(f"Fact {j} about the {t} is recorded in this note." for j in range(10))
    for t in TOPICS
]
QUESTIONS = [f"Which document mentions the {t}?" for t in TOPICS]
MAX_TOKENS = 4


def body(docs: list[str], question: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": question}],
        "documents": docs,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }


def workload(n: int, pool: list[str]) -> list[dict[str, Any]]:
    """n requests of three passages of `pool` in turning orders: most reuse passages earlier ones held.
    Each asks about a topic its passages hold: a question none answers leaves the full prefill torn
    between topics, where a splice may pick another and the comparison would test nothing but luck."""
    requests = []
    for i in range(n):
        picked = [(i + j * (1 + i % 2)) % len(pool) for j in range(3)]
        asked = DOCS.index(pool[picked[i % 3]])
        requests.append(body([pool[k] for k in picked], QUESTIONS[asked]))
    return requests


class Reference:
    """Full prefills (repair="full") on a replica without any store, one per distinct request."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._answers: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def tokens(self, request: dict[str, Any]) -> list[int]:
        key = json.dumps(request, sort_keys=True)
        with self._lock:
            if key not in self._answers:
                reply = post(self.url, {**request, "repair": "full"})
                assert reply.status == 200, reply.error
                self._answers[key] = reply.tokens
            return self._answers[key]


@pytest.fixture(scope="module")
def reference(default_model_dir: Path) -> Iterator[Reference]:
    with serve_process(FLAGS) as served:
        yield Reference(served.url)


@dataclass
class Reply:
    status: int | None  # None: no HTTP answer at all
    tokens: list[int]
    usage: dict[str, Any]
    error: str = ""


def post(url: str, request: dict[str, Any]) -> Reply:
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=request, timeout=180)
    except httpx.HTTPError as err:
        return Reply(None, [], {}, f"{type(err).__name__}: {err}")
    if r.status_code != 200:
        return Reply(r.status_code, [], {}, r.text[:300])
    answer = r.json()
    return Reply(200, answer["choices"][0]["token_ids"], answer["usage"])


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    wrong: int = 0

    def add(self, reply: Reply, expected: list[int]) -> None:
        self.sent += 1
        if reply.status == 200:
            self.completed += 1
            self.wrong += reply.tokens != expected
        else:
            self.failed += 1
            # A clear error: an HTTP error status with an explanation, not a cut connection or silence.
            assert reply.status is not None and reply.status >= 500 and reply.error, reply.error


def run(
    deployment: Deployment, reference: Reference, requests: list[dict[str, Any]], concurrency: int,
    fault: Callable[[list[Future[Reply]]], None],
) -> Tally:  # fmt: skip
    """Send `requests` through the router, `concurrency` at a time; `fault` runs meanwhile with the
    futures (to time itself on them). Every answer is checked against the reference."""
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(post, deployment.url, r) for r in requests]
        fault(futures)
        replies = [f.result() for f in futures]
    tally = Tally()
    for request, reply in zip(requests, replies, strict=True):
        tally.add(reply, reference.tokens(request))
    return tally


def metric(served: Served, name: str) -> float:
    return parse_metrics(httpx.get(f"{served.url}/metrics", timeout=10).text).get(name, 0.0)


def total(deployment: Deployment, name: str) -> float:
    return sum(metric(r, name) for r in deployment.replicas if r.process.poll() is None)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def done(futures: list[Future[Reply]], k: int) -> Callable[[], bool]:
    return lambda: sum(f.done() for f in futures) >= k


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.kill()


def two_replicas(redis: RedisServer, tmp_path: Path) -> contextlib.AbstractContextManager[Deployment]:
    return deploy(2, FLAGS, "round_robin", store_url=redis.url, router_log=tmp_path / "router.log")


def test_redis_killed_and_restarted_mid_run(redis: RedisServer, reference: Reference, tmp_path: Path) -> None:
    restarted: list[RedisServer] = []

    def fault(futures: list[Future[Reply]]) -> None:
        wait_for(done(futures, 4), "the first answers")
        redis.kill()
        wait_for(done(futures, 8), "answers while Redis is down")
        restarted.append(RedisServer(tmp_path / "redis", port=redis.port).start())

    requests = workload(12, DOCS[:4])
    # Passages no replica holds, so looked up in Redis: requests 6 and 7 start once
    # 5 and 6 have answered (two at a time), after the kill at 4 and before the restart at 8.
    requests[6], requests[7] = body(DOCS[4:5], QUESTIONS[4]), body(DOCS[5:6], QUESTIONS[5])
    try:
        with two_replicas(redis, tmp_path) as deployment:
            tally = run(deployment, reference, requests, concurrency=2, fault=fault)
            print(f"\nredis killed and restarted: {tally}")
            assert tally == Tally(sent=12, completed=12, failed=0, wrong=0)
            # The replicas did meet the dead server (a failed call, or one its open circuit skipped).
            met = ("kvsplice:store_errors_total", "kvsplice:store_skipped_calls_total")
            assert sum(total(deployment, name) for name in met) > 0
            # Once its circuit closes again, a passage no replica has seen is written to the new server.
            fresh = body(DOCS[6:], QUESTIONS[6])
            assert post(deployment.url, fresh).tokens == reference.tokens(fresh)
            wait_for(lambda: segment_keys(restarted[0].client()), "segment writes to the restarted Redis")
    finally:
        for server in restarted:
            server.kill()


def test_a_replica_killed_mid_run(redis: RedisServer, reference: Reference, tmp_path: Path) -> None:
    in_flight: list[float] = []

    def fault(futures: list[Future[Reply]]) -> None:
        victim = deployment.replicas[1]
        wait_for(lambda: metric(victim, "vllm:num_requests_running") > 0, "a request on the replica")
        in_flight.append(sum(metric(victim, f"vllm:num_requests_{s}") for s in ("running", "waiting")))
        victim.kill()

    with two_replicas(redis, tmp_path) as deployment:
        tally = run(deployment, reference, workload(12, DOCS[:4]), concurrency=4, fault=fault)
        print(f"\na replica killed with {in_flight[0]:.0f} requests in flight: {tally}")
        assert tally.sent == 12 and tally.wrong == 0
        # Only requests the killed replica held may fail (the router retries what it cannot connect to).
        assert tally.failed <= in_flight[0]
        assert tally.completed == 12 - tally.failed
        # The survivor's trust gate calibrated beside the fault: its audits ran.
        wait_for(lambda: total(deployment, "kvsplice:audit_tokens_total") > 0, "the gate's audits")


def segment_keys(client: Any) -> list[bytes]:
    """The segment entries in Redis, sorted (not the trust gate's record beside them)."""
    return sorted(k for k in client.keys("kvsplice:seg:*") if not k.startswith(b"kvsplice:seg:gate-"))


def test_a_corrupted_redis_entry_is_never_served(
    redis: RedisServer, reference: Reference, tmp_path: Path
) -> None:
    first, second = body(DOCS[:3], QUESTIONS[2]), body([DOCS[2], DOCS[0], DOCS[1]], QUESTIONS[2])
    with two_replicas(redis, tmp_path) as deployment:
        assert post(deployment.url, first).tokens == reference.tokens(first)
        (a,) = [r for r in deployment.replicas if metric(r, "vllm:request_success_total") == 1]
        (b,) = [r for r in deployment.replicas if r is not a]
        client = redis.client()
        wait_for(lambda: len(segment_keys(client)) >= 3, "A's passages in Redis")
        keys = segment_keys(client)
        assert len(keys) == 3
        value = bytearray(client.get(keys[0]))  # type: ignore[arg-type]
        # Half the KV bytes replaced, length kept: served, they would change the answer.
        quarter = len(value) // 4
        value[quarter : 3 * quarter] = random.Random(0).randbytes(2 * quarter)
        client.set(keys[0], bytes(value))
        # A holds the passages in its pool: without it, the router can only send the request to B.
        a.kill()
        reply = post(deployment.url, second)
        assert metric(b, "vllm:request_success_total") == 1
        print(f"\ncorrupted entry: B reused {reply.usage['store_hit_tokens']} tokens from Redis")
        assert reply.tokens == reference.tokens(second)
        assert metric(b, "kvsplice:store_corrupt_entries_total") == 1
        assert metric(b, "kvsplice:store_hits_total") == 2
        assert 0 < reply.usage["store_hit_tokens"] < reply.usage["prompt_tokens"]


def test_a_passage_computed_on_one_replica_is_a_segment_hit_on_the_other_through_the_router(
    redis: RedisServer, reference: Reference, tmp_path: Path
) -> None:
    first, second = body(DOCS[:3], QUESTIONS[0]), body([DOCS[2], DOCS[0], DOCS[1]], QUESTIONS[0])
    with two_replicas(redis, tmp_path) as deployment:
        assert post(deployment.url, first).status == 200
        (a,) = [r for r in deployment.replicas if metric(r, "vllm:request_success_total") == 1]
        wait_for(lambda: len(segment_keys(redis.client())) >= 3, "the passages in Redis")
        # Killed, not stopped: nothing it wrote at exit helps; only what is already in Redis does.
        a.kill()
        reply = post(deployment.url, second)
        usage = reply.usage
        reused = usage["segment_hit_tokens"] + usage["prefix_hit_tokens"]
        print(f"\nthrough the router: {reused} of {usage['prompt_tokens']} prompt tokens reused, "
              f"{usage['store_hit_tokens']} from Redis")  # fmt: skip
        assert reply.tokens == reference.tokens(second)
        assert usage["store_hit_tokens"] > 0
        assert reused >= 0.8 * usage["prompt_tokens"]
