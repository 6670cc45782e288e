"""Per-request engine options beyond sampling: the repair policy, its budget and the cache salt.

One validated type for the Python API, the server and the bench; a field left None takes the engine's
default from EngineConfig (`resolve`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsplice.errors import InvalidRequestError
from kvsplice.repair.registry import POLICY_NAMES

if TYPE_CHECKING:
    from kvsplice.config import EngineConfig


@dataclass(frozen=True)
class RepairSettings:
    """The resolved repair of one request. Hashable: segment keys tell requests with different settings
    apart by it."""

    policy: str
    # The budget, as a fraction of the reused segment tokens.
    ratio: float
    # Below this first-token margin after repair (top probability minus the runner-up's), the request
    # is prefilled in full: every reused token with approximate KV recomputed; 0: never.
    fallback_margin: float = 0.0


@dataclass(frozen=True)
class RequestOptions:
    repair: str | None = None
    recompute_ratio: float | None = None
    # Prefill in full a request whose first token, after repair, leads its runner-up by less than this
    # probability (EngineConfig.repair_fallback_margin).
    repair_fallback_margin: float | None = None
    # Tenant isolation: requests with different salts never share KV (prefix cache or segment store).
    cache_salt: str | None = None
    # Also prefill this request in full before it returns, and say in its metrics (the server's usage)
    # how far its answer was from the full prefill's (engine/audit.py).
    audit: bool = False

    def __post_init__(self) -> None:
        if self.repair is not None and self.repair not in POLICY_NAMES:
            raise InvalidRequestError(f"unknown repair policy {self.repair!r}; choose one of {POLICY_NAMES}")
        for name in ("recompute_ratio", "repair_fallback_margin"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1
            ):
                raise InvalidRequestError(f"{name} must be in [0, 1], got {value!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string")
        if not isinstance(self.audit, bool):
            raise InvalidRequestError("audit must be true or false")

    def resolve(self, config: EngineConfig) -> RepairSettings:
        """The settings with the engine's defaults (EngineConfig's fields of the same names) filled in."""
        return RepairSettings(
            self.repair if self.repair is not None else config.repair,
            float(self.recompute_ratio if self.recompute_ratio is not None else config.recompute_ratio),
            float(
                self.repair_fallback_margin
                if self.repair_fallback_margin is not None
                else config.repair_fallback_margin
            ),
        )

    def namespace(self, model: str) -> Hashable:
        """What KV may be shared within: the same model and the same salt."""
        return (model, self.cache_salt)
