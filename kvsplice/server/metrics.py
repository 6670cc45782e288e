"""Prometheus metrics of one server, in a registry of its own (several servers can share a process).

vLLM's names where kvsplice has the same quantity (`vllm:*`), kvsplice's own under `kvsplice:*`.
Per-request quantities are recorded by the engine thread as outputs arrive; engine totals (queue
lengths, KV pool, prefix cache, segment store) are read from the engine thread's latest snapshot
when /metrics is scraped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsplice.engine.audit import KL_BUCKETS
from kvsplice.engine.engine import StepOutput
from kvsplice.engine.stats import EngineStats
from kvsplice.tiers import TierStats, register_store_metrics

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        store_stats: Callable[[], Mapping[str, TierStats]] | None = None,
    ) -> None:
        """store_stats: the counters of the tiers below the KV pool, when the engine has any."""
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, labels = self.registry, ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        m = model_name
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished requests").labels(m)
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens").labels(m)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests", [*labels, "finished_reason"], registry=r
        )
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS).labels(
            m
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency", E2E_BUCKETS
        ).labels(m)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "Time a request waited before its prefill", E2E_BUCKETS
        ).labels(m)
        self.request_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", TOKEN_BUCKETS
        ).labels(m)
        self.request_generation = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", TOKEN_BUCKETS
        ).labels(m)
        self.prefix_hit_tokens = counter(
            "kvsplice:prefix_hit_tokens", "Prompt tokens whose KV came exactly from the prefix cache"
        ).labels(m)
        self.segment_hit_tokens = counter(
            "kvsplice:segment_hit_tokens", "Prompt tokens of marked segments whose KV was reused"
        ).labels(m)
        self.discovered_hit_tokens = counter(
            "kvsplice:discovered_hit_tokens",
            "Prompt tokens of spans found without markup (auto_segments) whose KV was reused",
        ).labels(m)
        self.store_hit_tokens = Counter(
            "kvsplice:store_hit_tokens",
            "Segment tokens loaded into the KV pool from a tier below it, by tier",
            [*labels, "tier"],
            registry=r,
        )
        self.recomputed_tokens = counter(
            "kvsplice:recomputed_tokens", "Reused segment tokens recomputed by the repair policy"
        ).labels(m)
        self.computed_tokens = counter(
            "kvsplice:computed_prompt_tokens", "Prompt tokens computed from scratch"
        ).labels(m)
        self.repair_fallbacks = counter(
            "kvsplice:repair_fallbacks",
            "Spliced requests prefilled in full because repair left their first token a near-tie",
        ).labels(m)
        self.errors = Counter(
            "kvsplice:request_errors",
            "Requests answered with an error, by HTTP status",
            [*labels, "status"],
            registry=r,
        )
        r.register(_EngineCollector(model_name, stats))
        if store_stats is not None:
            register_store_metrics(r, model_name, store_stats)

    def observe(self, step: StepOutput) -> None:
        """Record one engine output (called by the engine thread)."""
        self.generation_tokens.inc(len(step.new_token_ids))
        out = step.output
        if out is None:
            return
        m = out.metrics
        self.request_success.labels(self.model_name, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.ttft.observe(m.ttft_s)
        self.e2e.observe(m.e2e_s)
        self.queue_time.observe(m.queue_s)
        self.request_prompt.observe(m.prompt_tokens)
        self.request_generation.observe(m.generated_tokens)
        self.prefix_hit_tokens.inc(m.prefix_hit_tokens)
        self.segment_hit_tokens.inc(m.segment_hit_tokens)
        for tier, tokens in m.store_hit_tokens.items():
            self.store_hit_tokens.labels(self.model_name, tier).inc(tokens)
        self.discovered_hit_tokens.inc(m.discovered_hit_tokens)
        self.recomputed_tokens.inc(m.recomputed_tokens)
        self.computed_tokens.inc(m.computed_tokens)
        self.repair_fallbacks.inc(int(m.repair_fallback))

    def abort(self, request_id: str) -> None:
        """A request cancelled before it finished (its client went away)."""
        self.request_success.labels(self.model_name, "abort").inc()

    def error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        name = [self._model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        yield gauge("vllm:num_requests_running", "Requests in the decode batch", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted", s.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks held by running requests (1 = full)",
            s.num_request_blocks / s.num_blocks,
        )
        yield gauge("kvsplice:kv_cache_blocks", "KV blocks in the pool", s.num_blocks)
        yield gauge("kvsplice:kv_cache_request_blocks", "KV blocks held by running requests",
                    s.num_request_blocks)  # fmt: skip
        yield gauge(
            "kvsplice:kv_cache_used_blocks",
            "KV blocks referenced: running requests, plus cached prefixes and segments (evictable)",
            s.num_used_blocks,
        )
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up", s.prefix_cache_queries)
        yield counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_cache_hits
        )
        yield counter("kvsplice:segment_store_lookups", "Segment lookups", s.segment_lookups)
        yield counter("kvsplice:segment_store_hits", "Segment lookups that hit", s.segment_hits)
        yield counter("kvsplice:segment_store_inserted_tokens", "Tokens stored", s.segment_inserted_tokens)
        yield counter("kvsplice:segment_store_evictions", "Segments evicted", s.segment_evictions)
        yield counter(
            "kvsplice:segment_store_context_tokens",
            "Tokens computed to give stored segments more contexts (segment_kv.CONTEXTS), background work",
            s.segment_sampled_tokens,
        )
        yield counter(
            "kvsplice:segment_store_contexts_dropped",
            "Extra contexts of stored segments not computed: the segment was gone or memory short",
            s.segment_contexts_dropped,
        )
        yield counter(
            "kvsplice:segment_store_lead_tokens",
            "Tokens computed for stored segments' KV at a prompt's start (lead KV), background work",
            s.segment_lead_tokens,
        )
        yield counter(
            "kvsplice:segment_store_lead_hit_tokens",
            "Segment tokens spliced from their KV at a prompt's start (segment_kv.LEAD_KV)",
            s.segment_lead_hit_tokens,
        )
        yield counter(
            "kvsplice:segment_store_lead_evictions",
            "Lead KVs dropped for memory while their segment stayed stored (segment_kv.LEAD_KV)",
            s.segment_lead_evictions,
        )
        yield gauge("kvsplice:segment_store_entries", "Segments stored", s.segment_entries)
        yield gauge(
            "kvsplice:background_jobs_queued",
            "Store jobs (copies, fills, contexts, lead KV) not done yet: background work to come",
            s.background_queued,
        )
        yield counter(
            "kvsplice:prefill_tokens", "Query tokens computed by requests' prefills", s.prefill_tokens
        )
        yield counter(
            "kvsplice:prefill_flops", "FLOPs of requests' prefills (probes and repair)", s.prefill_flops
        )
        yield counter("kvsplice:decode_tokens", "Tokens computed by decode steps", s.decode_tokens)
        yield counter("kvsplice:decode_flops", "FLOPs of decode steps", s.decode_flops)
        yield counter(
            "kvsplice:background_tokens",
            "Query tokens computed as background work (segment contexts, lead KV, audits)",
            s.background_tokens,
        )
        yield counter("kvsplice:background_flops", "FLOPs of background work", s.background_flops)
        yield counter(
            "kvsplice:audit_tokens",
            "Of the background tokens: the live audit's and trust gate's full prefills and their decoding",
            s.audit_tokens,
        )
        yield counter("kvsplice:audit_flops", "Of the background FLOPs: the audits'", s.audit_flops)
        yield from _audit_metrics(self._model_name, s)


def _audit_metrics(model_name: str, s: EngineStats) -> Iterator[Metric]:
    """The live audit (engine/audit.py), by tenant salt and prompt shape."""
    labels = ["model_name", "salt", "shape"]
    requests = CounterMetricFamily(
        "kvsplice:audit_requests", "Spliced requests also prefilled in full to audit them", labels=labels
    )
    agreements = CounterMetricFamily(
        "kvsplice:audit_first_token_agreements",
        "Audited requests whose most likely first token is the full prefill's",
        labels=labels,
    )
    kl = HistogramMetricFamily(
        "kvsplice:audit_first_token_kl",
        "KL(full prefill || spliced) of the first token's distribution, in nats",
        labels=labels,
    )
    continuations = CounterMetricFamily(
        "kvsplice:audit_continuations", "Audited greedy requests whose answers were compared", labels=labels
    )
    agreeing = CounterMetricFamily(
        "kvsplice:audit_agreeing_tokens",
        "Leading answer tokens of audited greedy requests the full prefill's greedy decoding gives too",
        labels=labels,
    )
    same = CounterMetricFamily(
        "kvsplice:audit_same_continuations",
        "Audited greedy requests whose compared answer tokens all agree",
        labels=labels,
    )
    for cell in s.audits:
        values = [model_name, cell.salt, cell.shape]
        requests.add_metric(values, cell.requests)
        agreements.add_metric(values, cell.agreements)
        continuations.add_metric(values, cell.continuations)
        agreeing.add_metric(values, cell.agreeing_tokens)
        same.add_metric(values, cell.same_continuations)
        buckets = [
            ("+Inf" if math.isinf(b) else str(b), n) for b, n in zip(KL_BUCKETS, cell.kl_buckets, strict=True)
        ]
        kl.add_metric(values, buckets, sum_value=cell.kl_sum)
    yield requests
    yield agreements
    yield kl
    yield continuations
    yield agreeing
    yield same
    dropped = CounterMetricFamily(
        "kvsplice:audit_dropped",
        "Audits not run: the free KV blocks did not hold the prompt",
        labels=["model_name"],
    )
    dropped.add_metric([model_name], s.audits_dropped)
    yield dropped
    gate_labels = ["model_name", "cell"]
    fallbacks = CounterMetricFamily(
        "kvsplice:gate_fallbacks",
        "Spliced requests the trust gate prefilled in full (first token below its shape's margin)",
        labels=gate_labels,
    )
    tokens = CounterMetricFamily(
        "kvsplice:gate_fallback_tokens", "Tokens the trust gate's fallbacks recomputed", labels=gate_labels
    )
    margin = GaugeMetricFamily(
        "kvsplice:gate_margin",
        "First-token margin below which a shape falls back (+Inf: every request; absent: calibrating)",
        labels=gate_labels,
    )
    for g in s.gate:
        fallbacks.add_metric([model_name, g.key], g.fallbacks)
        tokens.add_metric([model_name, g.key], g.fallback_tokens)
        if g.threshold is not None:
            margin.add_metric([model_name, g.key], g.threshold)
    yield fallbacks
    yield tokens
    yield margin
