"""The store's one validated configuration: which tiers below the KV pool, their budgets and timeouts.

`EngineConfig.store` holds one (the CLI's --store-* options build it); every check is here, once.
Checks that need the outside world (the directory is writable, the Redis host resolves) run when the
tiers are built, at start-up, and raise the same `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from kvsplice.errors import ConfigError
from kvsplice.tiers.fingerprint import DTYPE_NAMES

REDIS_SCHEMES = ("redis", "rediss", "unix")


def _opt(help_text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": help_text}, **kwargs)


@dataclass(frozen=True)
class StoreConfig:
    store_dir: str | None = _opt("directory of the disk tier (None: no disk tier)", default=None)
    store_disk_gb: float = _opt("byte budget of store_dir in GiB, least recently used out", default=8.0)
    store_url: str | None = _opt(
        "redis://host:port/db (or rediss://, unix://) of a Redis or Valkey tier shared by replicas "
        "(None: no remote tier)",
        default=None,
    )
    store_ttl_s: int | None = _opt(
        "seconds a remote entry lives (None: until the server's maxmemory policy evicts it)", default=None
    )
    store_timeout_s: float = _opt(
        "connect and read/write timeout of the Redis tier in seconds: a dead server costs at most this",
        default=0.25,
    )
    store_breaker_failures: int = _opt(
        "consecutive Redis failures that open the circuit breaker (requests then skip the tier)", default=3
    )
    store_breaker_cooldown_s: float = _opt(
        "seconds the Redis circuit stays open before one request tries the server again", default=5.0
    )
    store_dtype: str | None = _opt(
        "dtype the tiers store KV in (None: the pool's; float16 halves float32's bytes)", default=None
    )
    store_write_queue_bytes: int = _opt(
        "bytes of entries waiting to be written, per tier; a write beyond it is dropped and counted",
        default=512 * 2**20,
    )

    def __post_init__(self) -> None:
        _check(self.store_dir is None or self.store_dir != "", "store_dir must be a path or None")
        _check(
            self.store_dir is not None or self.store_url is not None, "a store needs store_dir or store_url"
        )
        _check(self.store_disk_gb > 0, "store_disk_gb must be > 0")
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

    @property
    def store_dir_bytes(self) -> int:
        return int(self.store_disk_gb * 2**30)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
