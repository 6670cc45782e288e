"""The bench's notes on the shared splice engine's segment store: what it evicted, and what its
background work (more contexts per segment, lead KV) cost, warm-ups included: that work runs after
the requests that bring a segment, often unmeasured warm-ups."""

from __future__ import annotations

from kvsplice.bench.metrics import RequestRecord
from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine


def store_notes(engine: Engine, config: EngineConfig, records: list[RequestRecord]) -> list[str]:
    stats, work = engine.segment_store.stats, engine.store_work
    prompts = max(1, sum(r.prompt_tokens for r in records if not r.warmup))
    notes = []
    if stats.evictions:
        notes.append(f"the shared splice engine's segment store evicted {stats.evictions} entries")
    if stats.lead_evictions:
        notes.append(
            f"the shared splice engine's segment store dropped the lead KV of {stats.lead_evictions} "
            "entries it kept"
        )
    if config.segment_contexts > 1:
        notes.append(
            f"segment_contexts={config.segment_contexts}: the segment store computed "
            f"{stats.sampled_tokens:,} tokens to give segments more contexts, "
            f"{stats.sampled_tokens / prompts:.0%} of the measured requests' prompt tokens; "
            f"{work.samples_dropped} contexts dropped"
        )
    if config.segment_lead_kv and stats.lead_tokens:
        notes.append(
            f"segment_lead_kv: the segment store computed {stats.lead_tokens:,} tokens for segments' KV "
            f"at a prompt's start ({stats.lead_tokens / prompts:.0%} of the measured requests' prompt "
            f"tokens) and spliced {stats.lead_hit_tokens:,} tokens from it; {work.leads_dropped} dropped"
        )
        measured = [r for r in records if not r.warmup and r.segment_hit_tokens]
        if measured:
            exact = sum(r.segment_lead_tokens for r in measured) / sum(r.segment_hit_tokens for r in measured)
            notes.append(
                f"segment_lead_kv: {exact:.0%} of the measured requests' segment tokens were spliced from "
                "lead KV computed after the same prompt head (a full prefill's KV, left unrepaired)"
            )
    return notes
