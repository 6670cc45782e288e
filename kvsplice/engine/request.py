"""A request's state inside the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvsplice.cache.base import CacheSeq
from kvsplice.outputs import RequestMetrics, RequestOutput
from kvsplice.prompt import ParsedPrompt
from kvsplice.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RepairSettings:
    policy: str
    ratio: float
    tokens: int | None


@dataclass
class Request:
    request_id: str
    prompt: ParsedPrompt
    params: SamplingParams
    repair: RepairSettings
    # What the prefix cache sees; token_ids grows with the generated tokens.
    seq: CacheSeq
    generator: torch.Generator | None
    status: Status = Status.WAITING
    # Tokens whose KV is written (the last sampled token never is).
    kv_len: int = 0
    # The first position whose KV is approximate (reused KV spliced in and not fully recomputed: it and
    # every later token's KV); None while all KV is exact. Only exact KV may enter the prefix caches.
    exact_until: int | None = None
    # The prefix cache sees the request under segment keys (cache/segment_keys.py): all its KV may be
    # indexed, approximate or not, since only requests with the same segments and repair can match it.
    segment_keyed: bool = False
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    first_logits: torch.Tensor | None = None
    arrival: float = field(default_factory=time.perf_counter)
    # Segment spans missed at prefill, to compute on their own and store once the first token is out.
    pending_segments: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt.token_ids),
            token_ids=list(self.output_ids),
            text=self.text,
            finish_reason=self.finish_reason,
            metrics=self.metrics,
            first_logits=self.first_logits,
        )
