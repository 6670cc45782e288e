"""Write-through in the background: one thread and one bounded queue per tier.

A caller's put returns at once. Each tier has its own thread, so a slow or dead tier delays only its
own queue; when a queue holds `max_pending_bytes`, new writes to that tier are dropped and counted.
An entry is encoded once, by whichever writer needs it first, and shared by all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvsplice.tiers.tier import Tier

logger = logging.getLogger(__name__)


class Payload:
    """An entry's bytes, encoded on first use (off the caller's thread) and then shared."""

    def __init__(self, nbytes: int, encode: Callable[[], bytes | bytearray]) -> None:
        self.nbytes = nbytes
        self._encode: Callable[[], bytes | bytearray] | None = encode
        self._data: bytes | bytearray | None = None
        self._lock = threading.Lock()

    @classmethod
    def ready(cls, data: bytes | bytearray) -> Payload:
        return cls(len(data), lambda: data)

    def data(self) -> bytes | bytearray:
        with self._lock:
            if self._data is None:
                assert self._encode is not None
                self._data = self._encode()
                self._encode = None  # let go of the tensors it captured
            return self._data


class TierWriter:
    def __init__(self, tier: Tier, max_pending_bytes: int) -> None:
        assert max_pending_bytes > 0
        self.tier = tier
        self.max_pending_bytes = max_pending_bytes
        self._cond = threading.Condition()
        self._jobs: deque[tuple[str, Payload]] = deque()
        self._pending_bytes = 0
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvsplice-store-{tier.name}", daemon=True)
        self._thread.start()

    def submit(self, key: str, payload: Payload) -> bool:
        """Queue a write; False (and a counted drop) if the queue is full or the writer closed."""
        with self._cond:
            if self._closed or self._pending_bytes + payload.nbytes > self.max_pending_bytes:
                self.tier.counters.add(dropped_writes=1)
                return False
            self._jobs.append((key, payload))
            self._pending_bytes += payload.nbytes
            self._cond.notify_all()
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued write is done; False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._jobs or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Finish queued writes for up to `timeout_s`, then stop; writes still queued are dropped."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        with self._cond:
            self.tier.counters.add(dropped_writes=len(self._jobs))
            self._pending_bytes -= sum(payload.nbytes for _, payload in self._jobs)
            self._jobs.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                key, payload = self._jobs.popleft()
                self._busy = True
            try:
                self.tier.put(key, payload.data())
            except Exception as err:  # a bug must not kill the writer: count it, keep writing
                logger.exception("store tier %s: write failed", self.tier.name)
                self.tier.counters.error(self.tier.name, "write", err)
            finally:
                with self._cond:
                    self._pending_bytes -= payload.nbytes
                    self._busy = False
                    self._cond.notify_all()
