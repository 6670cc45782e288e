"""Prefill of one request: take the cached prefix, find reused segments, plan, place, repair, run.

This is DESIGN.md's flow, steps 2 to 6, for one request. Segments the store misses are computed in
place with the rest of the prompt (exact for this request), and computed again on their own after
the request's first token is out, to fill the store for later requests without delaying this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

from kvsplice.cache.base import PrefixCache
from kvsplice.cache.segment_keys import SegmentKeys
from kvsplice.cache.segments import SegmentEntry, SegmentStore
from kvsplice.engine.request import Request
from kvsplice.engine.runner import ModelRunner, Narrowing
from kvsplice.errors import OutOfBlocksError
from kvsplice.kv.pool import KVPool
from kvsplice.kv.splice import move_kv
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.models.config import ModelConfig
from kvsplice.planner import Plan, Span, SpanKind, make_plan
from kvsplice.repair import POLICIES, budget_tokens, make_policy


@dataclass(frozen=True)
class PrefillResult:
    plan: Plan
    logits: torch.Tensor  # [vocab] float32, at the last prompt token
    recomputed: int


class Prefiller:
    def __init__(
        self, runner: ModelRunner, pool: KVPool, prefix_cache: PrefixCache, store: SegmentStore, max_len: int
    ) -> None:
        self.runner = runner
        self.pool = pool
        self.prefix_cache = prefix_cache
        self.store = store
        self.max_len = max_len
        self.segment_keys = SegmentKeys(runner.cfg.vocab_size)

    def blocks_needed(self, request: Request) -> int:
        """Blocks for the whole request: prompt and every token it may generate (reserved at admission,
        so a running request never runs out of KV memory mid-decode)."""
        total = min(request.num_prompt_tokens + request.params.max_tokens, self.max_len)
        return -(-total // self.pool.block_size)

    def try_admit(self, request: Request) -> bool:
        """Take the cached prefix and reserve the request's blocks.

        False, holding nothing, if memory is short."""
        seq = request.seq
        self._choose_keys(request)
        hit = self.prefix_cache.acquire(seq)
        table = list(hit.blocks)
        partial = hit.num_tokens % self.pool.block_size
        try:
            fresh = self.pool.allocator.allocate(
                self.blocks_needed(request) - len(table) + (1 if partial else 0)
            )
        except OutOfBlocksError:
            seq.block_table = table
            self.prefix_cache.release(seq)
            seq.block_table = []
            return False
        if partial:
            # The last hit block is shared and only partly ours: copy its valid slots before writing.
            shared, own = table[-1], fresh.pop()
            offsets = torch.arange(partial, device=self.pool.device)
            self.pool.copy_slots(
                shared * self.pool.block_size + offsets, own * self.pool.block_size + offsets
            )
            self.pool.allocator.decref([shared])
            table[-1] = own
        seq.block_table = table + fresh
        request.metrics.prefix_hit_tokens = hit.num_tokens
        return True

    def _choose_keys(self, request: Request) -> None:
        """Plain token ids, or segment keys (cache/segment_keys.py) when the request splices with a
        policy that leaves KV approximate and they match at least as much: then its KV, approximate
        or not, enters the prefix cache under them and later requests that extend it reuse it."""
        seq, plain = request.seq, list(request.prompt.token_ids)
        seq.token_ids, request.segment_keyed = plain, False
        if not request.prompt.segments or POLICIES[request.repair.policy].exact:
            return
        keys = self.segment_keys(request.prompt, request.repair)
        if self.prefix_cache.peek(seq.namespace, keys) >= self.prefix_cache.peek(seq.namespace, plain):
            seq.token_ids, request.segment_keyed = keys, True

    def run(self, request: Request) -> PrefillResult:
        seq, prompt = request.seq, request.prompt
        n = len(prompt.token_ids)
        hit = request.metrics.prefix_hit_tokens
        entries: dict[int, SegmentEntry] = {}
        available = []
        for index, span in enumerate(prompt.segments):
            if span.end > hit and span.start < n - 1:
                tokens = prompt.segment_tokens(span)
                entry = self.store.lookup(seq.namespace, tokens)
                if entry is not None:
                    entries[index] = entry
                    available.append((span.start, span.end, index))
                elif tokens not in request.pending_segments:
                    request.pending_segments.append(tokens)
        plan = make_plan(n, hit, available)
        for spliced_span in plan.spliced():
            assert spliced_span.segment is not None
            entry = entries[spliced_span.segment]
            self._place(seq.block_table, spliced_span, entry)

        policy = make_policy(request.repair.policy)
        spliced = plan.tokens(SpanKind.SPLICED)
        budget = budget_tokens(spliced, request.repair.ratio, request.repair.tokens)
        decision = policy.decide(plan, budget, self.runner.cfg.num_layers)
        assert set(decision.recompute) <= set(plan.positions(SpanKind.SPLICED))
        queries = sorted(plan.positions(SpanKind.COMPUTE) + list(decision.recompute))
        narrowing = None
        recomputed = len(decision.recompute)
        if decision.probe_layers:
            query_index = {p: i for i, p in enumerate(queries)}
            candidates = torch.tensor([query_index[p] for p in decision.recompute], device=self.pool.device)
            narrowing = Narrowing(decision.probe_layers, candidates, lambda dev: policy.choose(dev, budget))
            recomputed = min(budget, len(decision.recompute))
        assert recomputed <= budget or policy.name == "full", (
            f"{policy.name} recomputed {recomputed} > {budget}"
        )
        logits = self.runner.prefill(seq.block_table, list(prompt.token_ids), queries, narrowing)
        assert logits is not None
        # KV stays exact (fit for the exact prefix caches) up to the first reused token not fully recomputed.
        approximate = sorted(
            set(plan.positions(SpanKind.SPLICED)) - set(decision.recompute if not narrowing else ())
        )
        request.exact_until = approximate[0] if approximate else None

        m = request.metrics
        m.prompt_tokens = n
        m.segment_hit_tokens = spliced
        m.computed_tokens = plan.tokens(SpanKind.COMPUTE)
        m.recomputed_tokens = recomputed
        m.prefill_flops = self.runner.last_flops
        return PrefillResult(plan, logits, recomputed)

    def store_segments(self, request: Request) -> None:
        """Compute each segment the store missed on its own, after the canonical context, and keep it."""
        context, namespace = self.store.context, request.seq.namespace
        for tokens in request.pending_segments:
            if self.store.lookup(namespace, tokens) is not None:
                continue
            try:
                context_blocks = self._context_blocks()
                blocks = self.pool.allocator.allocate(-(-len(tokens) // self.pool.block_size))
            except OutOfBlocksError:
                break  # the store is a cache: when running requests hold the memory, it simply misses later
            start = len(context)
            positions = list(range(start, start + len(tokens)))
            self.runner.prefill(context_blocks + blocks, list(context + tokens), positions, need_logits=False)
            self.store.insert(namespace, tokens, blocks)
            request.metrics.segment_store_tokens += len(tokens)
        request.pending_segments.clear()

    def _context_blocks(self) -> list[int]:
        """The canonical context's KV, computed the first time a segment is stored."""
        if self.store.context_blocks is None:
            context = self.store.context
            blocks = self.pool.allocator.allocate(len(context) // self.pool.block_size)
            if context:
                self.runner.prefill(blocks, list(context), list(range(len(context))), need_logits=False)
            self.store.context_blocks = blocks
        return self.store.context_blocks

    def _place(self, table: list[int], span: Span, entry: SegmentEntry) -> None:
        """Move a stored segment's KV (from its token span.segment_offset on) to the span's positions."""
        device = self.pool.device
        local = torch.arange(span.end - span.start, device=device) + span.segment_offset
        dst_pos = torch.arange(span.start, span.end, device=device)
        src = self.pool.slots(entry.blocks, local)
        dst = self.pool.slots(table, dst_pos)
        delta = dst_pos - self.store.start_position - local
        move_kv(self.pool, self.runner.cfg, self.runner.freqs, src, dst, delta)


def canonical_context(
    tokenizer: Tokenizer | None, cfg: ModelConfig, block_size: int, length: int | None
) -> tuple[int, ...]:
    """The context every stored segment is computed after: BOS (when the model expects one), then
    generic documents, cut to `length` tokens rounded up to whole blocks (None: the model's sliding
    window plus 64, or 256 tokens for a model without one). Empty for a model without a tokenizer."""
    if tokenizer is None:
        return ()
    if length is None:
        length = cfg.sliding_window + 64 if cfg.sliding_window else 256
    length = -(-length // block_size) * block_size
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    text = (resources.files("kvsplice") / "data" / "segment_context.txt").read_text()
    filler = tokenizer.encode(text)
    tokens = bos + filler * (1 + length // len(filler))
    return tuple(tokens[:length])
