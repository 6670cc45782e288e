"""The engine: owns the model, the KV pool and the caches, and advances every request one step at a time.

step():  store the segments a request missed, if one waits for that (a step of its own), else:
         batch = scheduler.schedule()
         logits = prefill of one request  |  batched decode of the running ones
         sample, append, detokenize, finish; release the finished requests' KV into the caches
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from kvsplice.cache.base import CacheSeq, make_prefix_cache
from kvsplice.cache.segments import SegmentStore
from kvsplice.config import EngineConfig
from kvsplice.engine.prefill import Prefiller, canonical_context
from kvsplice.engine.request import RepairSettings, Request, Status
from kvsplice.engine.runner import DecodeItem, ModelRunner
from kvsplice.engine.scheduler import Scheduler
from kvsplice.errors import InvalidRequestError, PromptTooLongError
from kvsplice.kv.pool import KVPool
from kvsplice.loader.model_files import resolve_model_dir
from kvsplice.loader.tokenizer import IncrementalDecoder, Tokenizer
from kvsplice.models.loader import load_model
from kvsplice.outputs import RequestOutput
from kvsplice.prompt import Prompt, parse_prompt
from kvsplice.repair import POLICY_NAMES
from kvsplice.sampling import SamplingParams, sample


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request: the new tokens and text, and the output once finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    output: RequestOutput | None


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
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
        context = canonical_context(
            self.tokenizer, self.model_config, config.block_size, config.segment_context_tokens
        )
        self.segment_store = SegmentStore(self.pool.allocator, context)
        self.prefiller = Prefiller(
            self.runner, self.pool, self.prefix_cache, self.segment_store, self.max_model_len
        )
        self.scheduler = Scheduler(config.max_num_seqs, self.prefiller.try_admit)
        self.eos_ids = frozenset(
            self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids
        )
        self._requests: dict[str, Request] = {}
        self._decoders: dict[str, IncrementalDecoder] = {}
        self._emitted: dict[str, int] = {}
        self._ids = itertools.count()
        # Requests whose missed segments still have to be computed on their own and stored.
        self._store_queue: deque[Request] = deque()

    # -- requests ---------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        repair: str | None = None,
        recompute_ratio: float | None = None,
        recompute_tokens: int | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError (or PromptTooLongError) for bad input."""
        parsed = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size)
        n = len(parsed.token_ids)
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens; this engine's context is {self.max_model_len} tokens "
                "(prompt plus at least one generated token)"
            )
        settings = self._repair_settings(repair, recompute_ratio, recompute_tokens)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt must be a string")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        namespace: Hashable = (str(self.model_dir), cache_salt)
        seed = params.seed if params.seed is not None else self.config.seed + next(self._ids)
        generator = None if params.greedy else torch.Generator(device=self.pool.device).manual_seed(seed)
        request = Request(
            request_id=request_id,
            prompt=parsed,
            params=params,
            repair=settings,
            seq=CacheSeq(request_id, namespace, list(parsed.token_ids)),
            generator=generator,
        )
        # One block to spare: admission copies a partial prefix hit into a fresh block while it still
        # holds the shared one (Prefiller.try_admit), so a request that needs every block never fits.
        if self.prefiller.blocks_needed(request) + 1 > self.pool.num_blocks:
            raise PromptTooLongError(
                f"prompt ({n} tokens) plus max_tokens ({params.max_tokens}) needs more KV "
                f"than the pool holds "
                f"({self.pool.capacity_tokens} tokens); raise kv_cache_gb or lower max_tokens"
            )
        self._requests[request_id] = request
        self._decoders[request_id] = IncrementalDecoder(self.tokenizer) if self.tokenizer else None  # type: ignore[assignment]
        self._emitted[request_id] = 0
        self.scheduler.add(request)
        return request_id

    def _repair_settings(self, policy: str | None, ratio: float | None, tokens: int | None) -> RepairSettings:
        policy = self.config.repair if policy is None else policy
        if policy not in POLICY_NAMES:
            raise InvalidRequestError(f"unknown repair policy {policy!r}; choose one of {POLICY_NAMES}")
        ratio = self.config.recompute_ratio if ratio is None else ratio
        if not isinstance(ratio, int | float) or not 0 <= ratio <= 1:
            raise InvalidRequestError(f"recompute_ratio must be in [0, 1], got {ratio!r}")
        tokens = self.config.recompute_tokens if tokens is None else tokens
        if tokens is not None and (not isinstance(tokens, int) or tokens < 0):
            raise InvalidRequestError(f"recompute_tokens must be an integer >= 0, got {tokens!r}")
        return RepairSettings(policy, float(ratio), tokens)

    def abort(self, request_id: str) -> None:
        """Cancel a request (a client went away): its blocks are released at once."""
        request = self._requests.get(request_id)
        if request is None:
            return
        self.scheduler.remove(request)
        request.finish_reason = "abort"
        self._finish(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._store_queue)

    # -- the step ---------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        if self._store_queue:
            # A step of its own, so that the first token of the request that missed the segments has
            # already gone out to its caller (a streaming client) when this work starts.
            stored = self._store_queue.popleft()
            self.prefiller.store_segments(stored)
            return []
        batch = self.scheduler.schedule()
        if batch.prefill is not None:
            request = batch.prefill
            request.metrics.queue_s = time.perf_counter() - request.arrival
            result = self.prefiller.run(request)
            request.kv_len = request.num_prompt_tokens
            self._computed(request)
            if request.params.return_first_logits:
                request.first_logits = result.logits.clone()
            if request.pending_segments:
                self._store_queue.append(request)
            return [self._append(request, result.logits)]
        if not batch.decode:
            return []
        items = [
            DecodeItem(r.seq.block_table, r.seq.token_ids[-1], len(r.seq.token_ids) - 1) for r in batch.decode
        ]
        logits = self.runner.decode(items)
        outputs = []
        for request, row in zip(batch.decode, logits, strict=True):
            request.kv_len += 1
            self._computed(request)
            outputs.append(self._append(request, row))
        return outputs

    def _computed(self, request: Request) -> None:
        # Under plain token ids the prefix cache sees only the exact part of the request's KV.
        exact = None if request.segment_keyed else request.exact_until
        request.seq.num_computed = request.kv_len if exact is None else min(request.kv_len, exact)
        self.prefix_cache.on_computed(request.seq)

    def _append(self, request: Request, logits: torch.Tensor) -> StepOutput:
        token = sample(logits, request.params, request.generator)
        now = time.perf_counter()
        if not request.output_ids:
            request.metrics.ttft_s = now - request.arrival
        request.output_ids.append(token)
        request.seq.token_ids.append(token)
        params = request.params
        decoder = self._decoders[request.request_id]
        is_eos = token in self.eos_ids and not params.ignore_eos
        if decoder is not None and not is_eos:
            request.text += decoder.push(token)
        if is_eos:
            request.finish_reason = "stop"
        elif len(request.output_ids) >= params.max_tokens or len(request.seq.token_ids) >= self.max_model_len:
            request.finish_reason = "length"
        if request.finish_reason is not None and decoder is not None:
            # Bytes of a character still incomplete when generation ends.
            request.text += decoder.flush()
        cuts = [cut for stop in params.stop if (cut := request.text.find(stop)) != -1]
        if cuts:
            request.text = request.text[: min(cuts)]
            request.finish_reason = "stop"
        # Text that might be the start of a stop string is held back until it is decided.
        text = request.text
        hold = 0 if request.finish_reason else max((_overlap(text, s) for s in params.stop), default=0)
        start = self._emitted[request.request_id]
        new_text = text[start : len(text) - hold]
        self._emitted[request.request_id] = start + len(new_text)
        output = None
        if request.finish_reason is not None:
            self.scheduler.remove(request)
            output = self._finish(request)
        return StepOutput(request.request_id, (token,), new_text, output)

    def _finish(self, request: Request) -> RequestOutput:
        if request.seq.block_table:
            self.prefix_cache.release(request.seq)
        request.status = Status.FINISHED
        request.metrics.generated_tokens = len(request.output_ids)
        request.metrics.e2e_s = time.perf_counter() - request.arrival
        del self._requests[request.request_id], self._decoders[request.request_id]
        del self._emitted[request.request_id]
        return request.to_output()


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
