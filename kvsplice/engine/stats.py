"""`Engine.stats()`: the engine's counters after its latest step, one named type. The server's /metrics,
the bench and the CLI read this, never the engine's fields.

Compute is counted whole: every forward pass the engine runs is a request's prefill, a decode step or
background work (copies into the segment store compute nothing; context samples, lead KV, the
canonical context and audits do; audits are also counted apart), and each is counted in tokens
(query positions through every layer they ran) and in FLOPs (models/flops.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsplice.engine.audit import AuditSummary
from kvsplice.repair.gate import GateCell


@dataclass(frozen=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 1
    # Blocks referenced by anyone: running requests, and the caches' evictable entries.
    num_used_blocks: int = 0
    # Blocks in the block tables of running requests (what vLLM's KV usage counts).
    num_request_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Tokens the prefix cache holds (0 for a cache that does not count them).
    prefix_cached_tokens: int = 0
    segment_lookups: int = 0
    segment_hits: int = 0
    segment_inserted_tokens: int = 0
    segment_evictions: int = 0
    segment_entries: int = 0
    segment_sampled_tokens: int = 0
    segment_contexts_dropped: int = 0
    segment_lead_tokens: int = 0
    segment_lead_hit_tokens: int = 0
    segment_lead_evictions: int = 0
    # Lead KVs not computed: the segment was gone or memory short.
    segment_leads_dropped: int = 0
    # Background jobs (copies, context samples, lead KV) not done yet.
    background_queued: int = 0
    # Compute since the engine started: requests' prefills (probes and repair included), decode steps,
    # and background work done for the segment store.
    prefill_tokens: int = 0
    prefill_flops: float = 0.0
    decode_tokens: int = 0
    decode_flops: float = 0.0
    background_tokens: int = 0
    background_flops: float = 0.0
    # Of the background work: the live audit's full prefills and their decoding (the trust gate's
    # calibration samples included).
    audit_tokens: int = 0
    audit_flops: float = 0.0
    # The live audit's results so far, by tenant salt and prompt shape, and the audits dropped for memory.
    audits: tuple[AuditSummary, ...] = ()
    audits_dropped: int = 0
    # The trust gate, by prompt shape: its samples, threshold and what its fallbacks cost.
    gate: tuple[GateCell, ...] = ()

    @property
    def total_flops(self) -> float:
        return self.prefill_flops + self.decode_flops + self.background_flops
