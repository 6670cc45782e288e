"""The store's one validated configuration: which tiers below the KV pool, their budgets and timeouts.

The engine's config (API, CLI, server) carries these fields and builds a `StoreConfig` from them;
every check is here, once. Checks that need the outside world (the directory is writable, the
Redis host resolves) run when the tiers are built, at start-up, and raise the same `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from kvsplice.errors import ConfigError
from kvsplice.store.fingerprint import DTYPE_NAMES

REDIS_SCHEMES = ("redis", "rediss", "unix")


@dataclass(frozen=True)
class StoreConfig:
    # Local directory tier; None: no disk tier.
    store_dir: str | None = None
    # Byte budget of the directory's entries; least recently used entries are deleted beyond it.
    store_dir_bytes: int = 8 * 2**30
    # Redis or Valkey URL (redis://, rediss://, unix://); None: no remote tier.
    store_url: str | None = None
    # Seconds a remote entry lives (None: until the server's maxmemory policy evicts it).
    store_ttl_s: int | None = None
    # Socket connect and read/write timeout of the remote tier: a dead server costs at most this.
    store_timeout_s: float = 0.25
    # Consecutive remote failures that open the circuit, and how long it stays open before a probe.
    store_breaker_failures: int = 3
    store_breaker_cooldown_s: float = 5.0
    # dtype the KV is stored in (None: as computed). float16/bfloat16 halve the bytes of float32 KV.
    store_dtype: str | None = None
    # Bytes of entries waiting to be written, per tier; a write beyond it is dropped (and counted).
    store_write_queue_bytes: int = 512 * 2**20

    def __post_init__(self) -> None:
        _check(self.store_dir is None or self.store_dir != "", "store_dir must be a path or None")
        _check(self.store_dir_bytes > 0, "store_dir_bytes must be > 0")
        if self.store_url is not None:
            scheme = urlsplit(self.store_url).scheme
            _check(
                scheme in REDIS_SCHEMES,
                f"store_url must be redis://, rediss:// or unix://, got {self.store_url!r}",
            )
        _check(self.store_ttl_s is None or self.store_ttl_s >= 1, "store_ttl_s must be >= 1 or None")
        _check(self.store_timeout_s > 0, "store_timeout_s must be > 0")
        _check(self.store_breaker_failures >= 1, "store_breaker_failures must be >= 1")
        _check(self.store_breaker_cooldown_s > 0, "store_breaker_cooldown_s must be > 0")
        _check(
            self.store_dtype is None or self.store_dtype in DTYPE_NAMES,
            f"store_dtype must be one of {DTYPE_NAMES} or None",
        )
        _check(self.store_write_queue_bytes > 0, "store_write_queue_bytes must be > 0")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
