"""The engine: owns the model, the KV pool and the caches, and advances every request one step at a time.

step():  store the KV of segments the last step's prefills missed (kept from those prefills)
         admit waiting requests (scheduler), preparing each one's prefill (reuse path)
         batch = scheduler.schedule(): decode tokens + prefill chunks under the token budget
         run the decode batch and the chunks (runner); sample, append, finish (output processor)
         spend budget nobody needed on background work: filling the segment store
         publish the step's KV events (when configured)

Segments entering the pool's segment store are written through to the tiers below it (disk,
Redis) in the background; a pool miss asks those tiers before computing (reuse/lower_tiers.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Hashable, Mapping

import torch

from kvsplice.cache.base import CacheSeq
from kvsplice.cache.registry import make_prefix_cache
from kvsplice.cache.segments import SegmentStore, canonical_context
from kvsplice.config import EngineConfig
from kvsplice.engine.auditor import Auditor
from kvsplice.engine.background import BackgroundWork
from kvsplice.engine.block_manager import BlockManager
from kvsplice.engine.gate_sync import GateSync
from kvsplice.engine.output import OutputProcessor, StepOutput
from kvsplice.engine.request import Request, Status
from kvsplice.engine.scheduler import Scheduler, StepBatch
from kvsplice.engine.stats import EngineStats
from kvsplice.errors import InvalidRequestError, PromptTooLongError, QueueFullError
from kvsplice.kv.pool import KVPool
from kvsplice.loader.model_files import resolve_model_dir
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.models.build import load_model
from kvsplice.models.runner import DecodeItem, ModelRunner
from kvsplice.options import RequestOptions
from kvsplice.outputs import RequestOutput
from kvsplice.prompt import Prompt, parse_prompt
from kvsplice.repair.gate import TrustGate
from kvsplice.reuse import segment_kv
from kvsplice.reuse.discover import MIN_SPAN_TOKENS, SpanFinder
from kvsplice.reuse.lower_tiers import LowerTiers, store_fingerprint
from kvsplice.reuse.path import Prefill, ReusePath, lead_head
from kvsplice.sampling import SamplingParams, sample
from kvsplice.tiers import KVEventPublisher, TieredStore
from kvsplice.tiers.metrics import TierStats
from kvsplice.tiers.recorder import KVEventRecorder

__all__ = ["Engine", "StepOutput"]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.threads)
        device = torch.device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        self.tokenizer = (
            Tokenizer.from_dir(self.model_dir) if (self.model_dir / "tokenizer.json").exists() else None
        )
        self.model = load_model(self.model_dir, config.torch_dtype, device)
        self.model_config = self.model.cfg
        self.pool = KVPool(
            self.model_config,
            int(config.kv_cache_gb * 2**30),
            config.block_size,
            config.torch_kv_dtype,
            device,
        )
        self.max_model_len = min(
            self.model_config.max_position_embeddings,
            config.max_model_len or 2**62,
            self.pool.capacity_tokens,
        )
        self.runner = ModelRunner(self.model, self.pool)
        self.prefix_cache = make_prefix_cache(config.prefix_cache, self.pool.allocator)
        context = canonical_context(self.tokenizer, self.model_config, config.block_size)
        self.segment_store = SegmentStore(self.pool.allocator, context)
        # Earlier prompts are kept to search in up to what the pool could hold as KV: ~9 bytes a token
        # against ~36 KB of KV a token on the default model.
        finder = SpanFinder(MIN_SPAN_TOKENS, self.pool.capacity_tokens) if config.auto_segments else None
        self.lower: LowerTiers | None = None
        if config.store is not None:
            fingerprint = store_fingerprint(self.model_dir, self.model_config, config, context)
            store = TieredStore.from_config(config.store, fingerprint)
            self.lower = LowerTiers(store, self.segment_store, self.pool)
        self.gate = TrustGate(config.fidelity_target) if config.fidelity_target > 0 else None
        # With tiers below, the gate's samples are kept there, beside the segments, and shared.
        self._gate_sync = (
            GateSync(self.gate, self.lower.store)
            if self.gate is not None and self.lower is not None
            else None
        )
        self.reuse = ReusePath(
            self.runner, self.pool, self.segment_store, self.prefix_cache, finder, self.lower, self.gate
        )
        self.events: KVEventRecorder | None = None
        if config.kv_events is not None:
            self.events = KVEventRecorder(KVEventPublisher(config.kv_events), config.block_size)
            self.prefix_cache.listener = self.events
            self.segment_store.watch(self.events)
        self.blocks = BlockManager(
            self.pool, self.prefix_cache, self.max_model_len, self.model_config.vocab_size
        )
        self.scheduler = Scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.prefill_chunk_cap,
        )
        eos = self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids
        self.outputs = OutputProcessor(self.tokenizer, frozenset(eos), self.max_model_len)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.background = BackgroundWork(
            self.segment_store,
            self.pool,
            self.runner,
            self.lower,
            segment_kv.CONTEXTS,
            segment_kv.LEAD_KV,
        )
        # Prompts for the span finder to index (their KV now computed), at the start of the next step.
        self._to_index: list[tuple[Hashable, tuple[int, ...]]] = []
        # Compute of requests' prefills and of decode steps, in tokens and FLOPs (Engine.stats).
        self.auditor = Auditor(self.runner, self.background, self.gate, config.audit_ratio)
        self._prefill_tokens = self._decode_tokens = 0
        self._closed = False
        self._prefill_flops = self._decode_flops = 0.0

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        options: RequestOptions | None = None,
        *,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError (or PromptTooLongError) for bad input."""
        options = options or RequestOptions()
        if not isinstance(options, RequestOptions):
            raise InvalidRequestError("options must be a RequestOptions")
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        n = len(parsed.token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; this engine's context is {self.max_model_len} tokens "
                "(prompt plus at least one generated token)"
            )
        if not self.blocks.fits_empty_pool(n, params.max_tokens):
            raise PromptTooLongError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs more KV than the pool "
                f"holds ({self.pool.capacity_tokens} tokens); raise kv_cache_gb or lower max_tokens"
            )
        scheduler = self.scheduler
        free_seats = max(0, scheduler.max_num_seqs - len(scheduler.running))
        if len(scheduler.waiting) >= self.config.max_waiting + free_seats:
            raise QueueFullError(
                f"{len(scheduler.waiting)} requests are already waiting "
                f"(max_waiting={self.config.max_waiting})"
            )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        settings = options.resolve(self.config)
        namespace = options.namespace(str(self.model_dir))
        seed = params.seed if params.seed is not None else self.config.seed + next(self._ids)
        generator = None if params.greedy else torch.Generator(device=self.pool.device).manual_seed(seed)
        request = Request(
            request_id=request_id,
            prompt=parsed,
            params=params,
            repair=settings,
            namespace=namespace,
            seq=CacheSeq(request_id, namespace, list(parsed.token_ids)),
            generator=generator,
            audit_asked=options.audit,
        )
        self._requests[request_id] = request
        self.outputs.add(request_id)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Cancel a request (a client went away): its blocks are released at once."""
        request = self._requests.get(request_id)
        if request is None:
            return
        request.finish_reason = "abort"
        self._finish(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.background.busy or bool(self._to_index)

    def stats(self) -> EngineStats:
        """The engine's counters now: requests, memory, caches, and every token it computed."""
        allocator, running = self.pool.allocator, self.scheduler.running
        prefix, segments, background = self.prefix_cache.stats, self.segment_store.stats, self.background
        return EngineStats(
            num_running=len(running),
            num_waiting=len(self.scheduler.waiting),
            num_blocks=allocator.num_blocks,
            num_used_blocks=allocator.num_used,
            num_request_blocks=len({b for r in running for b in r.seq.block_table}),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            prefix_cached_tokens=self.prefix_cache.num_cached_tokens,
            segment_lookups=segments.lookups,
            segment_hits=segments.hits,
            segment_inserted_tokens=segments.inserted_tokens,
            segment_evictions=segments.evictions,
            segment_entries=len(self.segment_store),
            segment_sampled_tokens=segments.sampled_tokens,
            segment_contexts_dropped=background.samples_dropped,
            segment_lead_tokens=segments.lead_tokens,
            segment_lead_hit_tokens=segments.lead_hit_tokens,
            segment_lead_evictions=segments.lead_evictions,
            segment_leads_dropped=background.leads_dropped,
            background_queued=background.queued,
            prefill_tokens=self._prefill_tokens,
            prefill_flops=self._prefill_flops,
            decode_tokens=self._decode_tokens,
            decode_flops=self._decode_flops,
            background_tokens=background.computed_tokens,
            background_flops=background.computed_flops,
            audit_tokens=background.audit_tokens,
            audit_flops=background.audit_flops,
            audits=self.auditor.audits.summary(),
            audits_dropped=self.auditor.audits.dropped,
            gate=self.gate.summary() if self.gate is not None else (),
        )

    @property
    def segment_shift(self) -> float:
        """The segment shift this engine repairs with: its model family's (repair/shift.py)."""
        return self.reuse.shift

    @property
    def tier_stats(self) -> Callable[[], Mapping[str, TierStats]] | None:
        """The counters of the tiers below the pool, by tier (thread-safe), when the engine has tiers."""
        return self.lower.store.stats if self.lower is not None else None

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        # Before admission, so that a request admitted now finds what the last step's prefills saw.
        self._index_prompts()
        self._admit()
        batch = self.scheduler.schedule()
        outputs = self._decode(batch) if batch.decode else []
        for request, tokens in batch.prefill:
            outputs += self._prefill_chunk(request, tokens)
        if batch.background_tokens > 0 and not self.background.copy(1):
            # One segment's copy a step, whatever the budget: a request that arrives while it runs waits
            # for one copy, not for every queued one. Fills (extra contexts, lead KV) take the step's
            # budget when no copy is queued.
            self.background.fill(batch.background_tokens)
        if self.events is not None:
            self.events.flush()
        if self._gate_sync is not None:
            self._gate_sync.tick()
        return outputs

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Copy the segments queued for the store and wait for the tiers below to write what they were
        given; False if the writes did not finish in time. Requests and fills are not run."""
        self.background.copy()
        return self.lower is None or self.lower.store.flush(timeout_s)

    def close(self) -> None:
        """Copy the segments queued for the store (the last requests' new documents: a copy is cheap,
        and without it they would never reach the tiers below), finish the tiers' queued writes (a few
        seconds at most) and the queued KV events, then release them. Requests still in the engine are
        not run, nor queued fills (extra contexts, lead KV), which would compute: the tiers hold each
        segment's KV from the prompt that brought it, written when it was stored. Closing twice does
        nothing more."""
        if self._closed:
            return
        self._closed = True
        self.background.copy()
        if self._gate_sync is not None:
            self._gate_sync.sync()
        if self.lower is not None:
            self.lower.close()
        if self.events is not None:
            self.events.close()

    def _admit(self) -> None:
        """Admit and prepare waiting requests while the scheduler allows, one way: the reuse path's
        lookup (data), then admission keyed by it (the block manager), then the prefill's preparation
        (the reuse path again). Blocks held for queued store copies are given back (the copies done
        now) when the head of the queue waits for memory."""
        while (request := self.scheduler.admissible()) is not None:
            lookup = self.reuse.lookup(request.namespace, request.prompt, self.blocks.plain_hit(request))
            admission = self.blocks.admit(request, lookup.first_found, lookup.exact_lead)
            if admission is None:
                # Each request was checked to fit an empty pool: only memory that running requests (or
                # queued store copies) hold can be missing. It waits at the head of the queue.
                if not self.background.holds_blocks:
                    assert self.scheduler.running, "a request that fits an empty pool waits in an idle engine"
                    return
                self.background.copy()
                continue
            self.scheduler.start(request, admission)
            request.metrics.queue_s = time.perf_counter() - request.arrival
            request.prefill = self.reuse.prepare(
                request.prompt,
                request.namespace,
                request.repair,
                request.seq.block_table,
                admission.prefix_hit_tokens,
                lookup,
                admission.approximate_from,
                admission.own_from,
                self.background.pending_kv(),
            )

    def _decode(self, batch: StepBatch) -> list[StepOutput]:
        items = [
            DecodeItem(r.seq.block_table, r.output_ids[-1], r.num_prompt_tokens + len(r.output_ids) - 1)
            for r in batch.decode
        ]
        result = self.runner.decode(items)
        self._decode_tokens += len(items)
        self._decode_flops += result.flops
        logits = result.logits
        assert logits is not None
        outputs = []
        for request, row in zip(batch.decode, logits, strict=True):
            request.kv_len += 1
            self.blocks.computed(request)
            outputs.append(self._sampled(request, row))
        return outputs

    def _prefill_chunk(self, request: Request, tokens: int) -> list[StepOutput]:
        prefill = request.prefill
        assert prefill is not None
        chunk = prefill.work.next_chunk(tokens)
        result = self.runner.forward(chunk)
        self._prefill_tokens += len(chunk.positions)
        self._prefill_flops += result.flops
        logits = prefill.work.complete(chunk, result)
        if not prefill.work.done:
            return []
        assert logits is not None
        request.kv_len = request.num_prompt_tokens
        self.blocks.computed(request)
        request.record_prefill()
        if request.params.return_first_logits:
            request.first_logits = logits.clone()
        self.auditor.prefilled(request, logits)
        self._store_missed(request, prefill)
        return [self._sampled(request, logits)]

    def _store_missed(self, request: Request, prefill: Prefill) -> None:
        """Queue the store work for the segments the prefill missed; none of it runs before the first
        token goes out."""
        if self.reuse.finder is not None:
            # Only what the prefix cache keeps under plain token ids, so that what is found there can
            # be moved from it: the exact part, or under segment keys what precedes them.
            prompt, admission = request.prompt, request.admission
            assert admission is not None
            exact = prefill.exact_until
            kept = len(prompt.token_ids) if exact is None else exact
            if admission.approximate_from is not None:
                kept = min(kept, admission.approximate_from)
            self._to_index.append((request.namespace, prompt.token_ids[:kept]))
        self.background.queue(request.namespace, request.seq.block_table, prefill, lead_head(request.prompt))

    def _index_prompts(self) -> None:
        """Index the prompts of finished prefills for the span finder (milliseconds)."""
        if self.reuse.finder is not None:
            for namespace, token_ids in self._to_index:
                self.reuse.finder.remember(namespace, token_ids)
        self._to_index = []

    def _sampled(self, request: Request, logits: torch.Tensor) -> StepOutput:
        token = sample(logits, request.params, request.generator)
        if not request.output_ids:
            request.metrics.ttft_s = time.perf_counter() - request.arrival
        assert request.admission is not None
        keyed = request.admission.segment_keyed
        request.seq.keys.append(self.blocks.segment_keys.generated(token, request.repair) if keyed else token)
        out = self.outputs.append(request, token)
        if request.finish_reason is None:
            return out
        return dataclasses.replace(out, output=self._finish(request))

    def _finish(self, request: Request) -> RequestOutput:
        if request.status is not Status.FINISHED:
            self.scheduler.remove(request)
        self.auditor.finished(request)
        if request.prefill is not None and not request.prefill.work.done:
            # Aborted mid-prefill: nothing will be stored from the earlier prompts' blocks it held.
            for b in request.prefill.borrowed:
                self.pool.allocator.decref(reversed(b.blocks))
        self.blocks.free(request)
        request.metrics.generated_tokens = len(request.output_ids)
        request.metrics.e2e_s = time.perf_counter() - request.arrival
        del self._requests[request.request_id]
        self.outputs.remove(request.request_id)
        return request.to_output()
