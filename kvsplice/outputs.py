"""What a request returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvsplice.engine.audit import AuditResult


@dataclass
class RequestMetrics:
    """Per-request accounting: prefix_hit_tokens + segment_hit_tokens + discovered_hit_tokens +
    computed_tokens == prompt_tokens."""

    prompt_tokens: int = 0
    # KV reused from the prefix cache: exact, except under segment keys, where it can be the KV an earlier
    # request with the same prompt start, segments and repair settings spliced (cache/segment_keys.py).
    prefix_hit_tokens: int = 0
    # KV of marked segments reused from the segment store: moved to new positions, then repaired.
    segment_hit_tokens: int = 0
    # Of those, the tokens spliced from a segment's lead KV computed after this very prompt head
    # (reuse/segment_kv.LEAD_KV): a full prefill's KV, which repair leaves alone.
    segment_lead_tokens: int = 0
    # Segment tokens this request loaded into the pool from a tier below it (disk, Redis), by tier,
    # and the seconds spent loading them (before its prefill could start).
    store_hit_tokens: dict[str, int] = field(default_factory=dict)
    store_load_s: float = 0.0
    # The same for spans found without markup (auto_segments): content earlier prompts carried.
    discovered_hit_tokens: int = 0
    # Prompt tokens computed from scratch (the last prompt token always is).
    computed_tokens: int = 0
    # Reused segment tokens (marked or found) recomputed by the repair policy on (most) layers.
    recomputed_tokens: int = 0
    # Repair left the first token a near-tie (below RequestOptions.repair_fallback_margin), so the
    # prefill recomputed every reused token with approximate KV: a full prefill's result and cost.
    repair_fallback: bool = False
    generated_tokens: int = 0
    # Estimated FLOPs of this request's prefill (segment-store fills are background work, not counted).
    prefill_flops: float = 0.0
    ttft_s: float = 0.0
    # Where the request asked for its own audit (RequestOptions.audit): how far its answer was from a full
    # prefill's (None: not asked, or no free KV blocks to run it).
    audit: AuditResult | None = None
    e2e_s: float = 0.0
    queue_s: float = 0.0

    @property
    def reused_tokens(self) -> int:
        return self.prefix_hit_tokens + self.segment_hit_tokens + self.discovered_hit_tokens

    def summary(self) -> str:
        """One line a person can read: where the prompt's KV came from, and the time to first token."""
        return (
            f"{self.prompt_tokens} prompt tokens: {self.prefix_hit_tokens} from the prefix cache, "
            f"{self.segment_hit_tokens} reused from marked segments, {self.discovered_hit_tokens} from "
            f"spans found in earlier prompts ({self.recomputed_tokens} of them "
            f"recomputed to repair{', a full prefill after a near-tie' if self.repair_fallback else ''}), "
            f"{self.computed_tokens} computed; "
            f"time to first token {self.ttft_s:.2f} s"
        )


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # "stop" (EOS or a stop string), "length" (max_tokens or the context), "abort".
    finish_reason: str | None = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # Float32 logits [vocab] at the first generated position, when SamplingParams.return_first_logits.
    first_logits: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
