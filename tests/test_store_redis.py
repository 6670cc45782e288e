"""The Redis tier against a real redis-server started here: round trips, corruption and forged keys
refused, salts isolated, and a server killed mid-run: errors counted, the circuit opens, nothing
raises, and the tier reconnects when the server is back."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvsplice.errors import ConfigError
from kvsplice.tiers import DiskTier, RedisTier, StoreConfig, TieredStore, encode_entry, entry_key
from kvsplice.tiers.breaker import CircuitBreaker
from kvsplice.tiers.remote import KEY_PREFIX
from tests.test_store_support import RedisServer, assert_same_kv, fingerprint, segment

FP = fingerprint()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield srv
    if srv.process is not None:
        srv.kill()


@pytest.fixture
def redis_url(server: RedisServer) -> str:
    server.client().flushall()
    return server.url


def raw_get(client: redis.Redis, key: str) -> bytes:
    value = client.get(key)
    assert isinstance(value, bytes)
    return value


def redis_tier(
    url: str,
    *,
    failures: int = 3,
    cooldown_s: float = 5.0,
    ttl_s: int | None = None,
) -> RedisTier:
    return RedisTier(url, ttl_s=ttl_s, timeout_s=0.2, breaker=CircuitBreaker(failures, cooldown_s))


def test_round_trip_and_a_second_replica_reads_what_the_first_wrote(redis_url: str) -> None:
    tokens, kv = segment(40)
    a = TieredStore(FP, [redis_tier(redis_url)], store_dtype="float16")
    b = TieredStore(FP, [redis_tier(redis_url)])
    assert b.get("", tokens) is None
    a.put("", tokens, kv)
    assert a.flush()
    hit = b.get("", tokens)
    assert hit is not None and hit.tier == "redis"
    for got, want in zip(hit.kv.layers, kv.layers, strict=True):
        assert got is not None and want is not None
        assert (got.k - want.k).abs().max() < 1e-2  # stored as float16
    s = b.stats()["redis"]
    assert (s.hits, s.misses, s.errors, s.bytes_read) == (1, 1, 0, hit.nbytes)
    assert a.stats()["redis"].writes == 1
    a.close()
    b.close()


def test_ttl_is_set_when_asked(server: RedisServer, redis_url: str) -> None:
    tokens, kv = segment(4)
    store = TieredStore(FP, [redis_tier(redis_url, ttl_s=120)])
    store.put("", tokens, kv)
    assert store.flush()
    assert 0 < server.client().ttl(KEY_PREFIX + entry_key(FP, "", tokens)) <= 120


def test_bit_flip_truncation_and_forged_values_are_deleted_counted_and_missed(
    server: RedisServer, redis_url: str
) -> None:
    raw = server.client()
    store = TieredStore(FP, [redis_tier(redis_url)])
    cases = []
    for seed in range(3):
        tokens, kv = segment(16, seed)
        store.put("", tokens, kv)
        cases.append(tokens)
    assert store.flush()
    flipped, cut, forged = (KEY_PREFIX + entry_key(FP, "", tokens) for tokens in cases)
    data = bytearray(raw_get(raw, flipped))
    data[100] ^= 0x01
    raw.set(flipped, bytes(data))
    raw.set(cut, raw_get(raw, cut)[:-1000])
    # A valid entry of another model (float32 vs bfloat16 KV) written under this model's key.
    other = fingerprint(kv_dtype="bfloat16")
    raw.set(forged, bytes(encode_entry(other, "", cases[2], segment(16, 2)[1], "float32")))
    for tokens in cases:
        assert store.get("", tokens) is None
    assert raw.exists(flipped, cut, forged) == 0
    s = store.stats()["redis"]
    assert (s.corrupt, s.misses, s.hits) == (3, 3, 0)


def test_salts_never_cross_in_any_tier(tmp_path: Path, redis_url: str) -> None:
    tokens, kv = segment(8)
    store = TieredStore(FP, [DiskTier(tmp_path, 10**7), redis_tier(redis_url)])
    store.put("tenant-a", tokens, kv)
    assert store.flush()
    for salt in ("tenant-b", "", "tenant-A"):
        assert store.get(salt, tokens) is None
    hit = store.get("tenant-a", tokens)
    assert hit is not None and hit.tier == "disk"
    assert sum(s.misses for s in store.stats().values()) == 6


def test_a_remote_hit_is_written_back_to_disk(tmp_path: Path, redis_url: str) -> None:
    tokens, kv = segment(8)
    writer = TieredStore(FP, [redis_tier(redis_url)])
    writer.put("", tokens, kv)
    assert writer.flush()
    reader = TieredStore(FP, [DiskTier(tmp_path, 10**7), redis_tier(redis_url)])
    first = reader.get("", tokens)
    assert first is not None and first.tier == "redis"
    assert reader.flush()
    second = reader.get("", tokens)
    assert second is not None and second.tier == "disk"
    assert_same_kv(second.kv, kv)


def test_server_killed_mid_run_errors_counted_circuit_opens_then_reconnects(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis").start()
    try:
        tier = redis_tier(server.url, failures=3, cooldown_s=0.5)
        store = TieredStore(FP, [tier])
        entries = [segment(16, seed) for seed in range(12)]
        for tokens, kv in entries[:4]:
            store.put("", tokens, kv)
        assert store.flush()
        assert all(store.get("", tokens) is not None for tokens, _ in entries[:4])

        server.kill()
        start = time.perf_counter()
        for tokens, kv in entries[4:]:  # a run of requests: each looks up, misses, writes through
            assert store.get("", tokens) is None
            store.put("", tokens, kv)
        assert store.flush()
        elapsed = time.perf_counter() - start
        s = store.stats()["redis"]
        # The circuit opens after 3 consecutive failures (one more call may be in flight then:
        # the caller's and the writer thread's); every later call is refused without a round trip.
        assert 3 <= s.errors <= 4, "no retry storm"
        assert tier.breaker.state == "open" and tier.breaker.trips == 1
        assert s.skipped == 16 - s.errors  # 8 gets + 8 puts
        assert s.dropped_writes >= 1 and s.hits == 4
        assert elapsed < 2.0  # at most 3 timeouts of 0.2 s, not one per call

        server.start()  # back on the same port, empty (no persistence)
        time.sleep(0.6)  # the cooldown passes: the next call is the probe
        assert store.get("", entries[0][0]) is None
        assert tier.breaker.state == "closed"
        store.put("", *entries[0])
        assert store.flush()
        assert store.get("", entries[0][0]) is not None
        assert store.stats()["redis"].errors == s.errors
        store.close()
    finally:
        if server.process is not None:
            server.kill()


def test_a_failed_probe_opens_the_circuit_again(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")  # never started: nothing listens on the port
    tier = redis_tier(server.url, failures=1, cooldown_s=0.2)
    store = TieredStore(FP, [tier])
    assert store.get("", [1, 2]) is None
    assert tier.breaker.state == "open"
    time.sleep(0.25)
    assert store.get("", [1, 2]) is None  # the probe fails
    assert tier.breaker.trips == 2 and store.stats()["redis"].errors == 2


def test_a_host_that_does_not_resolve_is_a_start_up_error() -> None:
    with pytest.raises(ConfigError, match="does not resolve"):
        redis_tier("redis://no-such-host.invalid:6379/0")
    with pytest.raises(ConfigError, match="store_url"):
        StoreConfig(store_url="http://localhost:6379")
    with pytest.raises(ConfigError, match="does not resolve"):
        TieredStore.from_config(StoreConfig(store_url="redis://no-such-host.invalid"), FP)


def test_from_config_builds_disk_then_redis(tmp_path: Path, redis_url: str) -> None:
    config = StoreConfig(store_dir=str(tmp_path / "kv"), store_disk_gb=0.01, store_url=redis_url)
    store = TieredStore.from_config(config, FP)
    assert [tier.name for tier in store.tiers] == ["disk", "redis"]
    with pytest.raises(ConfigError, match="store_dir or store_url"):
        StoreConfig()
