"""Which tokens run in the next engine step: one batch under a token budget.

Every step, in this order, up to `max_num_batched_tokens` tokens:
1. every running request that has finished its prefill decodes one token;
2. requests still in prefill get chunks of their prefill, first-come first-served: in a first round
   each takes at most `long_prefill_token_threshold` tokens, so a long prompt cannot hold back a short
   one that arrived during its prefill; what is left goes round again, in the same order, uncapped
   (a repair pass with the segment shift takes whole samples, repair/shift.py: a chunk may exceed its
   share by the sample that starts it, and a sample that does not fit the step waits for a later one,
   except in the step's first prefill chunk, which may exceed the budget by it);
3. waiting requests are admitted in arrival order (the head of the queue is never skipped, so none
   starves) while seats, memory and budget last, and take their first chunk in the same rounds;
4. budget nobody needed is left for background work (filling the segment store), but only in a step
   with no prefill in it and no request waiting.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvsplice.engine.request import Admission, Request, Status


@dataclass(frozen=True)
class StepBatch:
    decode: tuple[Request, ...]
    # Requests in prefill and how many of their next prefill tokens run this step.
    prefill: tuple[tuple[Request, int], ...]
    # Tokens background work may use this step.
    background_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int,
    ) -> None:
        assert max_num_batched_tokens > max_num_seqs, "every running request must fit a step's budget"
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        # In admission order, which is arrival order.
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admissible(self) -> Request | None:
        """The oldest waiting request, if a seat and some of this step's budget remain (the head of the
        queue is never skipped). The engine admits it, or finds memory short, before asking again."""
        if not self.waiting or len(self.running) >= self.max_num_seqs or self._spare_budget() <= 0:
            return None
        return self.waiting[0]

    def start(self, request: Request, admission: Admission) -> None:
        """The head of the queue was admitted: it runs. The engine prepares its prefill (request.prefill)
        before asking for the next one."""
        assert self.waiting[0] is request, "requests are admitted in arrival order"
        self.waiting.popleft()
        request.status, request.admission = Status.RUNNING, admission
        self.running.append(request)

    def schedule(self) -> StepBatch:
        budget = self.max_num_batched_tokens
        decode = tuple(r for r in self.running if r.prefill is not None and not r.in_prefill)
        budget -= len(decode)
        prefilling = [r for r in self.running if r.in_prefill]
        grants: dict[str, int] = {}
        for cap in (self.long_prefill_token_threshold, None):
            for request in prefilling:
                assert request.prefill is not None
                given = grants.get(request.request_id, 0)
                left = request.prefill.work.remaining - given
                want = min(left, budget) if cap is None else min(left, budget, max(cap - given, 0))
                if want <= 0:
                    continue
                take = request.prefill.work.chunk_tokens(given + want) - given
                if take > budget and grants:
                    # A segment shift's sample that does not fit what is left waits for a step of its
                    # own; the first prefill granted in a step may take one larger than the whole budget,
                    # so every request makes progress.
                    continue
                if take > 0:
                    grants[request.request_id] = given + take
                    budget -= take
        prefill = tuple((r, grants[r.request_id]) for r in prefilling if r.request_id in grants)
        # A step's outputs go out when all of it has run: background work shares no step with a prefill,
        # so no first token ever waits for it.
        return StepBatch(decode, prefill, 0 if self.waiting or prefill else budget)

    def remove(self, request: Request) -> None:
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
        request.status = Status.FINISHED

    def _spare_budget(self) -> int:
        """Budget left this step after the running requests' shares (prefills at their capped share)."""
        used = 0
        for request in self.running:
            assert request.prefill is not None, "every admitted request is prepared before the next"
            if request.in_prefill:
                assert request.prefill is not None
                used += min(request.prefill.work.remaining, self.long_prefill_token_threshold)
            else:
                used += 1
        return self.max_num_batched_tokens - used
