"""Which requests run in the next engine step: one prefill, or one batched decode of every running request.

New requests are admitted first (time to first token matters most), up to `max_num_seqs` running
at once and as long as the KV pool can reserve their blocks; otherwise the running requests decode
together in one batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvsplice.engine.request import Request, Status


@dataclass(frozen=True)
class Batch:
    prefill: Request | None
    decode: tuple[Request, ...] = ()


class Scheduler:
    def __init__(self, max_num_seqs: int, admit: Callable[[Request], bool]) -> None:
        self.max_num_seqs = max_num_seqs
        self._admit = admit
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        if self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if self._admit(request):
                self.waiting.popleft()
                request.status = Status.RUNNING
                self.running.append(request)
                return Batch(prefill=request)
            # Nothing running holds memory that could be freed: admission can only fail for lack of
            # memory the running requests hold, and each request was checked to fit an empty pool.
            assert self.running, f"request {request.request_id} cannot be admitted into an idle engine"
        return Batch(prefill=None, decode=tuple(self.running))

    def remove(self, request: Request) -> None:
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
