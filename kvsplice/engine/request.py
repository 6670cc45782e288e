"""A request's state inside the engine."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import torch

from kvsplice.cache.base import CacheSeq
from kvsplice.engine.audit import AuditFill
from kvsplice.options import RepairSettings
from kvsplice.outputs import RequestMetrics, RequestOutput
from kvsplice.plan import SpanKind
from kvsplice.prompt import ParsedPrompt
from kvsplice.reuse.path import Prefill
from kvsplice.sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Admission:
    """What admission gave a request: its cached prefix (its blocks are the start of seq.block_table,
    which holds room for the whole request) and how the prefix cache keys it."""

    prefix_hit_tokens: int
    # Where its segment keys start (cache/segment_keys.py): all its KV may be indexed, approximate or
    # not, and nothing before it may be spliced. None: keyed by its plain token ids.
    approximate_from: int | None
    # Where the request's own blocks start (a multiple of the block size, at most the hit): KV before it
    # lies in blocks shared with the prefix cache, which it must not write.
    own_from: int

    @property
    def segment_keyed(self) -> bool:
        return self.approximate_from is not None


@dataclass
class Request:
    request_id: str
    prompt: ParsedPrompt
    params: SamplingParams
    repair: RepairSettings
    namespace: Hashable
    # What the prefix cache sees; its keys grow with the generated tokens.
    seq: CacheSeq
    generator: torch.Generator | None
    status: Status = Status.WAITING
    admission: Admission | None = None
    # The prefill's plan and work, from admission until the request finishes.
    prefill: Prefill | None = None
    # Tokens whose KV is written (the last sampled token never is).
    kv_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    first_logits: torch.Tensor | None = None
    # The request asked for its own audit (RequestOptions.audit); the audit decided for it once its
    # prefill is done, run when it finishes ("exact": its KV was a full prefill's, nothing to run).
    audit_asked: bool = False
    audit: AuditFill | Literal["exact"] | None = None
    arrival: float = field(default_factory=time.perf_counter)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.prefill is not None and not self.prefill.work.done

    @property
    def indexable_len(self) -> int:
        """Tokens whose KV the prefix cache may index: all written KV under segment keys; under plain
        token ids only the exact part (reused KV spliced in and not recomputed is approximate). Under
        segment keys the tokens before them keep their ids, so they must be exact: where a lead KV
        the keys were chosen by was dropped before the plan, only the exact part is indexed."""
        assert self.admission is not None and self.prefill is not None
        exact = self.prefill.exact_until
        keyed_from = self.admission.approximate_from
        if keyed_from is not None and (exact is None or exact >= keyed_from):
            return self.kv_len
        return self.kv_len if exact is None else min(self.kv_len, exact)

    def record_prefill(self) -> None:
        """Count what the prefill reused, computed and loaded into the metrics, once it is done."""
        prefill, m = self.prefill, self.metrics
        assert prefill is not None and prefill.work.done and self.admission is not None
        plan = prefill.plan
        m.prompt_tokens = self.num_prompt_tokens
        m.prefix_hit_tokens = self.admission.prefix_hit_tokens
        m.discovered_hit_tokens = plan.discovered_tokens
        m.segment_hit_tokens = plan.tokens(SpanKind.SPLICED) - m.discovered_hit_tokens
        m.segment_lead_tokens = plan.lead_tokens
        m.computed_tokens = plan.tokens(SpanKind.COMPUTE)
        m.recomputed_tokens = prefill.recomputed
        m.repair_fallback = prefill.repair.fell_back
        m.prefill_flops = prefill.work.flops
        for promoted in prefill.promoted:
            m.store_hit_tokens[promoted.tier] = m.store_hit_tokens.get(promoted.tier, 0) + promoted.num_tokens
            m.store_load_s += promoted.load_s

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
