"""Per-request engine options beyond sampling: the repair policy, its budget and the cache salt.

One validated type for the Python API, the server and the bench; a field left None takes the engine's
default from EngineConfig (`resolve`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass

from kvsplice.errors import InvalidRequestError
from kvsplice.repair.registry import POLICY_NAMES


@dataclass(frozen=True)
class RepairSettings:
    """The resolved repair of one request: policy name and budget (tokens, else a ratio of the reused
    segment tokens), or the quality target of a policy without a budget (KL in nats). Hashable: segment
    keys tell requests with different settings apart by it."""

    policy: str
    ratio: float
    tokens: int | None
    target: float = 0.0
    # How much of the error its recomputed tokens show is moved onto a segment's other tokens
    # (repair/shift.py); 0: none.
    shift: float = 0.0
    # Below this first-token margin after repair (top probability minus the runner-up's), the request
    # is prefilled in full: every reused token with approximate KV recomputed; 0: never.
    fallback_margin: float = 0.0


@dataclass(frozen=True)
class RequestOptions:
    repair: str | None = None
    recompute_ratio: float | None = None
    recompute_tokens: int | None = None
    # The adaptive policy's quality target: the KL (nats) between successive rounds of repair.
    repair_target: float | None = None
    # Tenant isolation: requests with different salts never share KV (prefix cache or segment store).
    cache_salt: str | None = None
    # The segment shift of repair (repair/shift.py): a scale in [0, 1].
    repair_shift: float | None = None
    # Prefill in full a request whose first token, after repair, leads its runner-up by less than this
    # probability (EngineConfig.repair_fallback_margin).
    repair_fallback_margin: float | None = None

    def __post_init__(self) -> None:
        if self.repair is not None and self.repair not in POLICY_NAMES:
            raise InvalidRequestError(f"unknown repair policy {self.repair!r}; choose one of {POLICY_NAMES}")
        for name in ("recompute_ratio", "repair_shift", "repair_fallback_margin"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1
            ):
                raise InvalidRequestError(f"{name} must be in [0, 1], got {value!r}")
        tokens = self.recompute_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0):
            raise InvalidRequestError(f"recompute_tokens must be an integer >= 0, got {tokens!r}")
        target = self.repair_target
        if target is not None and (
            isinstance(target, bool) or not isinstance(target, int | float) or not 0 <= target < math.inf
        ):
            raise InvalidRequestError(f"repair_target must be a number >= 0 (a KL in nats), got {target!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string")

    def resolve(
        self,
        repair: str,
        recompute_ratio: float,
        recompute_tokens: int | None,
        repair_target: float,
        repair_shift: float,
        repair_fallback_margin: float,
    ) -> RepairSettings:
        """The settings with the engine's defaults (EngineConfig's fields of the same names) filled in."""
        return RepairSettings(
            self.repair if self.repair is not None else repair,
            float(self.recompute_ratio if self.recompute_ratio is not None else recompute_ratio),
            self.recompute_tokens if self.recompute_tokens is not None else recompute_tokens,
            float(self.repair_target if self.repair_target is not None else repair_target),
            float(self.repair_shift if self.repair_shift is not None else repair_shift),
            float(
                self.repair_fallback_margin
                if self.repair_fallback_margin is not None
                else repair_fallback_margin
            ),
        )

    def namespace(self, model: str) -> Hashable:
        """What KV may be shared within: the same model and the same salt."""
        return (model, self.cache_salt)


def salt_key(namespace: Hashable) -> str:
    """The part of a `namespace` that entries below the pool and KV events are keyed by: the cache salt
    ("" for none). The model part is the store fingerprint's: a path differs between machines that
    serve the same weights."""
    assert isinstance(namespace, tuple) and len(namespace) == 2, "a namespace is (model, cache_salt)"
    salt = namespace[1]
    return "" if salt is None else "salt:" + salt
