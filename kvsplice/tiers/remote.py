"""The remote tier: Redis or Valkey, shared by every replica that points at it.

One value per key, written with a single SET (atomic: a reader sees the old value, the new one, or
none), optionally with a TTL. Eviction is the server's: run it with a memory cap and an evicting
policy (`maxmemory 8gb`, `maxmemory-policy allkeys-lru`); under the default `noeviction` a full
server refuses writes, which are counted as errors and lose nothing else. Socket timeouts are short
and redis-py's own retries are off: the circuit breaker decides when to try a dead server again.
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvsplice.errors import ConfigError
from kvsplice.tiers.breaker import CircuitBreaker
from kvsplice.tiers.tier import Tier

KEY_PREFIX = "kvsplice:seg:"


class RedisTier(Tier):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int | None,
        timeout_s: float,
        breaker: CircuitBreaker,
    ) -> None:
        """Raises ConfigError if the URL is malformed or its host does not resolve. A server that is
        down at start-up is not an error: the tier misses until it comes up."""
        super().__init__()
        _check_resolves(url)
        self.url = url
        self.ttl_s = ttl_s
        self.breaker = breaker
        try:
            self._client = redis.Redis.from_url(
                url,
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
                health_check_interval=0,
            )
        except ValueError as err:
            raise ConfigError(f"store_url {url!r} is not a valid Redis URL: {err}") from err

    def get(self, key: str) -> bytes | None:
        if not self.breaker.allow():
            self.counters.add(skipped=1)
            return None
        try:
            data = self._client.get(KEY_PREFIX + key)
        except redis.RedisError as err:
            self._failed("GET", err)
            return None
        self.breaker.success()
        if data is None:
            return None
        assert isinstance(data, bytes)
        self.counters.add(bytes_read=len(data))
        return data

    def put(self, key: str, data: bytes | bytearray) -> bool:
        if not self.breaker.allow():
            self.counters.add(skipped=1, dropped_writes=1)
            return False
        try:
            self._client.set(KEY_PREFIX + key, data, ex=self.ttl_s)
        except redis.RedisError as err:
            self._failed("SET", err)
            return False
        self.breaker.success()
        self.counters.add(writes=1, bytes_written=len(data))
        return True

    def delete(self, key: str) -> None:
        if not self.breaker.allow():
            self.counters.add(skipped=1)
            return
        try:
            self._client.delete(KEY_PREFIX + key)
        except redis.RedisError as err:
            self._failed("DEL", err)
            return
        self.breaker.success()

    def close(self) -> None:
        self._client.close()

    def _failed(self, what: str, err: redis.RedisError) -> None:
        # An error reply (a full server refusing a write) comes from a live server: only a failure to
        # reach it counts towards opening the circuit.
        if isinstance(err, redis.ResponseError):
            self.breaker.success()
        else:
            self.breaker.failure()
        self.counters.error(self.name, what, err)


def _check_resolves(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        return  # a socket path: nothing to resolve; a missing socket is a server that is down
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ConfigError(f"store_url {url!r}: expected redis://host[:port][/db] or rediss:// or unix://")
    try:
        port = parts.port or 6379
        socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError) as err:
        raise ConfigError(f"store_url {url!r}: host {parts.hostname!r} does not resolve: {err}") from err
