"""A circuit breaker: after N consecutive failures, stop calling a dead service for a cooldown.

closed: calls go through; a failure streak of `failure_threshold` opens the circuit.
open: calls are refused (no network round trip, no timeout to wait out) until `cooldown_s` passed.
half-open: exactly one call (the probe) goes through; its success closes the circuit, its failure
opens it for another cooldown. So a dead server costs one timeout per cooldown, not one per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self, failure_threshold: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        assert failure_threshold >= 1 and cooldown_s > 0
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        # Times the circuit opened (a closed -> open or half-open -> open transition).
        self.trips = 0

    @property
    def state(self) -> State:
        with self._lock:
            return self._state()

    def allow(self) -> bool:
        """May a call go through now? In half-open state, True for one caller until it reports back."""
        with self._lock:
            state = self._state()
            if state == "closed":
                return True
            if state == "half_open" and not self._probing:
                self._probing = True
                return True
            return False

    def success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            if self._probing or (self._opened_at is None and self._failures >= self.failure_threshold):
                self._opened_at = self._clock()
                self.trips += 1
            self._probing = False

    def _state(self) -> State:
        if self._opened_at is None:
            return "closed"
        return "open" if self._clock() - self._opened_at < self.cooldown_s else "half_open"
