"""The store below the pool, driven through the engine: a segment outlives its engine on disk, a
corrupt entry is never served, a Redis that dies mid-run changes no output, and KV events describe
what the caches hold. A tiny random-weight Gemma 3 (sliding windows shorter than the documents) and
token-id prompts; every engine runs a real disk tier or a real redis-server."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import pytest
import torch
import zmq

from kvsplice import LLM, SamplingParams, Segment
from kvsplice.config import EngineConfig
from kvsplice.errors import ConfigError
from kvsplice.options import RequestOptions
from kvsplice.outputs import RequestOutput
from kvsplice.tiers import router_block_hashes, segment_hash
from kvsplice.tiers.config import StoreConfig
from tests import tiny_models
from tests.test_store_events import decode_batch
from tests.test_store_support import RedisServer, segment_files

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, return_first_logits=True)
rng = random.Random(13)
SYSTEM = [rng.randrange(1, 320) for _ in range(11)]
DOCS = [[rng.randrange(1, 320) for _ in range(rng.randint(28, 40))] for _ in range(8)]
QUESTION = [rng.randrange(1, 320) for _ in range(7)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gemma3")
    tiny_models.save("Gemma3ForCausalLM", directory)
    return directory


def make_llm(model_dir: Path, **kwargs: object) -> LLM:
    settings = {"block_size": 8, "kv_cache_gb": 0.01, "num_threads": 1, "prefix_cache": "off", **kwargs}
    return LLM(model=str(model_dir), **settings)


def prompt(order: list[int]) -> list:
    return [SYSTEM, *(Segment(DOCS[i]) for i in order), QUESTION]


def run(llm: LLM, order: list[int]) -> RequestOutput:
    return llm.generate([prompt(order)], GREEDY)[0]


def assert_same_output(got: RequestOutput, want: RequestOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.first_logits is not None and want.first_logits is not None
    torch.testing.assert_close(got.first_logits, want.first_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "fields",
    [
        {"store": {"store_url": "http://localhost:6379"}},
        {"store": {"store_dir": ""}},
        {"store": {"store_dir": "/tmp/s", "store_disk_gb": 0}},
        {"store": {"store_url": "redis://h:1/0", "store_ttl_s": 0}},
        {"store": {"store_dir": "/tmp/s", "store_dtype": "float64"}},
        {"store": {"store_url": "redis://h:1/0", "store_timeout_s": 0}},
        {"store": {"store_url": "redis://h:1/0", "store_breaker_failures": 0}},
        {"store": {"store_ttl_s": 60}},
        {"store": {"store_dir": "/tmp/s", "no_such_field": 1}},
        {"store": "/tmp/s"},
        {"kv_events": {"endpoint": "localhost:5557"}},
        {"kv_events": {"replay_endpoint": "tcp://*:5558", "endpoint": "http://x"}},
        {"kv_events": 5557},
    ],
)
def test_bad_store_and_event_settings_are_config_errors(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_a_store_flag_without_a_tier_is_an_error() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_args(parser)
    with pytest.raises(ConfigError, match="--store-ttl-s need --store-dir or --store-url"):
        EngineConfig.from_args(parser.parse_args(["--store-ttl-s", "60"]))
    with pytest.raises(ConfigError, match="--kv-events-topic need --kv-events-endpoint"):
        EngineConfig.from_args(parser.parse_args(["--kv-events-topic", "kv@a@b"]))


def test_the_flags_build_the_store_config() -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_args(parser)
    flags = ["--store-dir", "/tmp/s", "--store-disk-gb", "0.5", "--store-url", "redis://h:1/0"]
    flags += ["--store-ttl-s", "60", "--store-dtype", "float16", "--store-breaker-failures", "5"]
    config = EngineConfig.from_args(parser.parse_args(flags))
    store = config.store
    assert store is not None
    assert (store.store_dir, store.store_dir_bytes, store.store_url, store.store_ttl_s) == (
        "/tmp/s", 2**29, "redis://h:1/0", 60,
    )  # fmt: skip
    assert (store.store_dtype, store.store_breaker_failures, store.store_timeout_s) == ("float16", 5, 0.25)
    assert config.kv_events is None
    assert EngineConfig.from_args(parser.parse_args([])).store is None
    events = EngineConfig.from_args(parser.parse_args(["--kv-events-endpoint", "tcp://*:5599"])).kv_events
    assert events is not None and (events.endpoint, events.topic) == ("tcp://*:5599", "")
    # The Python API takes the same nested configuration, or a dict of its fields.
    assert EngineConfig(store={"store_dir": "/tmp/s"}).store == StoreConfig(store_dir="/tmp/s")


def test_an_unwritable_store_dir_fails_at_start_up(model_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="store_dir"):
        make_llm(model_dir, store={"store_dir": str(blocker / "store")})


def test_a_segment_outlives_its_engine_on_disk(model_dir: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    a = make_llm(model_dir, store={"store_dir": store})
    run(a, [0, 1])
    want = run(a, [1, 0])
    assert want.metrics.segment_hit_tokens > 0 and not want.metrics.store_hit_tokens
    a.close()
    assert len(segment_files(tmp_path / "store")) == 2

    b = make_llm(model_dir, store={"store_dir": store})
    got = run(b, [1, 0])
    assert got.metrics.segment_hit_tokens == want.metrics.segment_hit_tokens
    assert got.metrics.store_hit_tokens == {"disk": len(DOCS[0]) + len(DOCS[1])}
    assert got.metrics.store_load_s > 0
    assert_same_output(got, want)
    assert b.engine.lower is not None and b.engine.lower.store.stats()["disk"].hits == 2
    # The promoted segments now live in B's pool: the next request hits there, not on disk.
    again = run(b, [0, 1])
    assert again.metrics.segment_hit_tokens > 0 and not again.metrics.store_hit_tokens
    b.close()

    # Without the disk tier a fresh engine has nothing to reuse: the hits above came from it.
    cold = run(make_llm(model_dir), [1, 0])
    assert cold.metrics.segment_hit_tokens == 0


def test_closing_right_after_the_first_request_still_writes_its_segments(
    model_dir: Path, tmp_path: Path
) -> None:
    # The copy into the store is background work after the request has answered: close() must do it,
    # or the documents of an engine's last requests never reach the disk.
    a = make_llm(model_dir, store={"store_dir": str(tmp_path / "store")})
    # One token: the request finishes in the step that prefilled it, before any step could copy.
    a.generate([prompt([0, 1])], SamplingParams(max_tokens=1, temperature=0.0))
    assert a.engine.background.busy
    a.close()
    assert len(segment_files(tmp_path / "store")) == 2
    got = run(make_llm(model_dir, store={"store_dir": str(tmp_path / "store")}), [1, 0])
    assert got.metrics.store_hit_tokens == {"disk": len(DOCS[0]) + len(DOCS[1])}


def test_a_float16_store_halves_the_entries_and_serves_close_kv(model_dir: Path, tmp_path: Path) -> None:
    sizes = {}
    for dtype in ("float32", "float16"):
        a = make_llm(model_dir, store={"store_dir": str(tmp_path / dtype), "store_dtype": dtype})
        run(a, [0, 1])
        want = run(a, [1, 0])
        a.close()
        sizes[dtype] = sum(f.stat().st_size for f in segment_files(tmp_path / dtype))
        got = run(make_llm(model_dir, store={"store_dir": str(tmp_path / dtype)}), [1, 0])
        assert got.metrics.store_hit_tokens == {"disk": len(DOCS[0]) + len(DOCS[1])}
        assert got.first_logits is not None and want.first_logits is not None
        if dtype == "float32":
            assert_same_output(got, want)
        else:
            # Rounded KV: close to the float32 store's answer, and not bit-identical to it.
            torch.testing.assert_close(got.first_logits, want.first_logits, atol=5e-2, rtol=0)
            assert not torch.equal(got.first_logits, want.first_logits)
    # The KV is most of an entry; the header (token ids, fingerprint) is the rest.
    assert 0.5 < sizes["float16"] / sizes["float32"] < 0.6


def test_another_salt_or_dtype_never_reads_an_entry(model_dir: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    a = make_llm(model_dir, store={"store_dir": store})
    a.generate([prompt([2])], GREEDY, RequestOptions(cache_salt="tenant-a"))
    a.close()
    b = make_llm(model_dir, store={"store_dir": store})
    other = b.generate([prompt([2])], GREEDY, RequestOptions(cache_salt="tenant-b"))[0]
    assert other.metrics.segment_hit_tokens == 0
    same = b.generate([prompt([2])], GREEDY, RequestOptions(cache_salt="tenant-a"))[0]
    assert same.metrics.store_hit_tokens == {"disk": len(DOCS[2])}
    # Another KV dtype is another fingerprint: another key, never a hit.
    c = make_llm(model_dir, store={"store_dir": store}, kv_dtype="bfloat16")
    other_dtype = c.generate([prompt([2])], GREEDY, RequestOptions(cache_salt="tenant-a"))[0]
    assert other_dtype.metrics.segment_hit_tokens == 0


def test_a_corrupt_entry_is_deleted_counted_and_recomputed(model_dir: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    a = make_llm(model_dir, store={"store_dir": str(store)})
    run(a, [0, 1])
    a.close()
    files = segment_files(store)
    assert len(files) == 2
    flipped = bytearray(files[0].read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    files[0].write_bytes(flipped)
    files[1].write_bytes(files[1].read_bytes()[:-100])

    b = make_llm(model_dir, store={"store_dir": str(store)})
    got = run(b, [1, 0])
    stats = b.engine.lower.store.stats()["disk"]  # type: ignore[union-attr]
    assert (stats.corrupt, stats.hits) == (2, 0)
    assert got.metrics.segment_hit_tokens == 0 and not got.metrics.store_hit_tokens
    # Recomputed: the same output as an engine without the tier.
    assert_same_output(got, run(make_llm(model_dir), [1, 0]))
    b.close()
    # The corrupt files were replaced by the segments B computed and wrote through.
    assert len(segment_files(store)) == 2


def test_redis_killed_mid_run_changes_no_output_and_the_engine_reconnects(
    model_dir: Path, tmp_path: Path
) -> None:
    server = RedisServer(tmp_path / "redis").start()
    with_redis = make_llm(model_dir, store={"store_url": server.url})
    without = make_llm(model_dir)
    # Documents first seen before, during and after the outage, and reused across it.
    orders = [[0, 1], [1, 2], [3, 0], [4, 2], [5, 1], [3, 4]]
    lower = with_redis.engine.lower
    assert lower is not None
    try:
        for i, order in enumerate(orders):
            if i == 2:
                assert lower.store.flush()
                assert len(server.client().keys("kvsplice:seg:*")) == 3
                server.kill()
            assert_same_output(run(with_redis, order), run(without, order))
        stats = lower.store.stats()["redis"]
        assert stats.errors > 0 and stats.skipped + stats.errors >= 3
        server.start()
        # The circuit lets a probe through once its cooldown (5 s) has passed: the lookup of a new
        # document reaches the new (empty) server and closes it; the write-through follows.
        time.sleep(5.5)
        assert_same_output(run(with_redis, [6]), run(without, [6]))
        assert lower.store.flush()
        assert len(server.client().keys("kvsplice:seg:*")) == 1
        replica = make_llm(model_dir, store={"store_url": server.url})
        assert run(replica, [6, 7]).metrics.store_hit_tokens == {"redis": len(DOCS[6])}
        replica.close()
    finally:
        with_redis.close()
        if server.process is not None:
            server.kill()


def test_kv_events_name_the_blocks_and_segments_the_caches_hold(model_dir: Path, tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    # Full repair keeps KV exact, so the cache indexes plain token ids (cache/segment_keys.py).
    llm = make_llm(model_dir, prefix_cache="hash", repair="full", kv_events={"endpoint": endpoint})
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)  # a PUB socket drops what it sends before a subscriber has joined
    out = run(llm, [0, 1])
    llm.close()
    events = []
    while sub.poll(2000):
        _, _, payload = sub.recv_multipart()
        events += decode_batch(payload)[1]
    sub.close()
    stored = [e for e in events if e[0] == "BlockStored"]
    segments = {e[1]: e[2] for e in events if e[0] == "SegmentStored"}
    assert segments == {segment_hash("", DOCS[i]): len(DOCS[i]) for i in (0, 1)}
    # The prompt's blocks, under the hashes a router computes from the prompt's tokens.
    prompt_ids = out.prompt_token_ids
    want = router_block_hashes(prompt_ids, 8)
    hashes = [h for e in stored for h in e[1]]
    assert hashes[: len(want)] == want
    assert stored[0][2] is None and stored[0][4] == 8


@pytest.mark.parametrize("prefix_cache", ["radix", "hash"])
def test_kv_events_remove_only_what_they_stored(model_dir: Path, tmp_path: Path, prefix_cache: str) -> None:
    endpoint = f"ipc://{tmp_path}/events"
    # A pool of ~30 blocks: the prefix cache and the segment store evict each other's entries.
    llm = make_llm(
        model_dir, prefix_cache=prefix_cache, kv_cache_gb=0.00025, kv_events={"endpoint": endpoint}
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(0.3)
    for order in ([0, 1], [2, 3], [1, 0], [4, 5], [3, 2], [6, 7], [0, 7]):
        run(llm, order)
    llm.close()
    live: dict[str, list[int]] = {"block": [], "segment": []}
    removed = {"block": 0, "segment": 0}
    while sub.poll(2000):
        _, _, payload = sub.recv_multipart()
        for event in decode_batch(payload)[1]:
            if event[0] == "BlockStored":
                live["block"] += event[1]
            elif event[0] == "SegmentStored":
                live["segment"].append(event[1])
            else:
                kind = "block" if event[0] == "BlockRemoved" else "segment"
                for h in event[1] if kind == "block" else [event[1]]:
                    live[kind].remove(h)  # raises if it was never stored
                    removed[kind] += 1
    sub.close()
    assert removed["block"] > 0 and removed["segment"] > 0
    assert len(live["segment"]) == len(llm.engine.segment_store)
