"""The OpenAI-compatible HTTP API over one engine: /v1/completions, /v1/chat/completions, /v1/models,
/health and /metrics. See docs/server.md for the request extensions (segments, repair, cache_salt)."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from kvsplice.engine.audit import KL_BUCKETS
from kvsplice.engine.engine import Engine
from kvsplice.errors import QueueFullError
from kvsplice.outputs import RequestOutput
from kvsplice.prompt import Prompt
from kvsplice.sampling import SamplingParams
from kvsplice.server.config import ServerConfig
from kvsplice.server.engine_loop import (
    AsyncEngine,
    EngineFailure,
    EngineUnavailableError,
    RequestGroup,
)
from kvsplice.server.errors import APIError, from_validation_error, install_handlers
from kvsplice.server.metrics import ServerMetrics
from kvsplice.server.prompts import chat_prompt, completion_prompts
from kvsplice.server.protocol import ChatCompletionRequest, CompletionRequest, finish_reason, usage

logger = logging.getLogger(__name__)
_Body = TypeVar("_Body", bound=BaseModel)


def served_model_name(engine: Engine, config: ServerConfig) -> str:
    if config.served_model_name is not None:
        return config.served_model_name
    if engine.config.model is not None:
        return engine.config.model
    from kvsplice.loader.gguf import default_model_path

    return Path(default_model_path()).stem


class OpenAIServer:
    """The handlers; one per app, around one AsyncEngine."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.config = config
        self.model_name = served_model_name(engine, config)
        # The tiers' counters are thread-safe: a scrape reads them directly, not through the engine thread.
        self.metrics = ServerMetrics(self.model_name, lambda: self.engine.stats, engine.tier_stats)
        self.engine = AsyncEngine(engine, on_output=self.metrics.observe, on_abort=self.metrics.abort)
        self.tokenizer = engine.tokenizer
        self.audit_ratio = engine.config.audit_ratio
        self.fidelity_target = engine.config.fidelity_target
        self.created = int(time.time())

    # -- endpoints --------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await _parse(request, CompletionRequest)
        self._check_model(body.model)
        body.check_supported()
        prompts = completion_prompts(body.prompt)
        params = self._sampling(body, body.max_tokens)
        return await self._serve(request, body, prompts, params, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        self._authorize(request)
        body = await _parse(request, ChatCompletionRequest)
        self._check_model(body.model)
        body.check_supported()
        prompt = chat_prompt(self.tokenizer, body.messages, body.documents, body.add_generation_prompt)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = self._sampling(
            body, max_tokens if max_tokens is not None else self.config.default_max_tokens
        )
        return await self._serve(request, body, [prompt], params, chat=True)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        engine = self.engine.engine
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvsplice",
            "root": str(engine.model_dir),
            "parent": None,
            "max_model_len": engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: Request) -> Response:
        if not self.engine.healthy:
            raise APIError(503, self.engine.broken or "the engine is not running")
        return Response(status_code=200)

    async def audit(self, request: Request) -> JSONResponse:
        """The live audit so far: per tenant salt and prompt shape, how many spliced requests were also
        prefilled in full, how often the first token agreed, the first token's KL and how much of greedy
        answers agreed; and per cell the trust gate's samples, the margin below which it falls back
        (null: calibrating) and the cost."""
        self._authorize(request)
        stats = self.engine.stats
        cells = [
            {
                "salt": c.salt,
                "shape": c.shape,
                "requests": c.requests,
                "first_token_agreement": c.first_token_agreement,
                "kl_mean": c.kl_mean,
                "within_kl_0.05": c.kl_buckets[KL_BUCKETS.index(0.05)] / c.requests,
                # Greedy requests: leading answer tokens the full prefill's greedy decoding gives too.
                "continuations": c.continuations,
                "agreeing_tokens_mean": c.agreeing_tokens / c.continuations if c.continuations else None,
                "same_continuation": c.same_continuations / c.continuations if c.continuations else None,
            }
            for c in stats.audits
        ]
        gate = [
            {
                "cell": g.key,
                "samples": g.samples,
                # JSON has no infinity: "all" where every request of the shape falls back.
                "fallback_below_margin": "all" if g.threshold == math.inf else g.threshold,
                "kl_mean_spliced": g.kl_mean,
                "fallbacks": g.fallbacks,
                "fallback_tokens": g.fallback_tokens,
            }
            for g in stats.gate
        ]
        return JSONResponse(
            {
                "audit_ratio": self.audit_ratio,
                "fidelity_target": self.fidelity_target,
                "dropped": stats.audits_dropped,
                "cells": cells,
                "gate": gate,
            }
        )

    async def prometheus(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # -- the shared path --------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        key = self.config.api_key
        if key is not None:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def _sampling(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
    ) -> SamplingParams:
        return body.sampling_params(max_tokens)

    async def _serve(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompts: list[Prompt],
        params: SamplingParams,
        chat: bool,
    ) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            group = await self.engine.submit(request_id, prompts, params, body.request_options())
        except QueueFullError as exc:
            retry = {"Retry-After": str(self.config.retry_after_s)}
            raise APIError(
                429, f"the server is busy: {exc}; retry later", code="queue_full", headers=retry
            ) from exc
        except EngineUnavailableError as exc:
            retry = {"Retry-After": str(self.config.retry_after_s)}
            raise APIError(503, str(exc), code="engine_unavailable", headers=retry) from exc
        meta = _Meta(request_id, int(time.time()), self.model_name, chat, body.return_token_ids)
        if body.stream:
            return StreamingResponse(
                _sse(self._stream(group, meta, body.include_usage)),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await self._complete(request, group, meta)

    async def _complete(self, request: Request, group: RequestGroup, meta: _Meta) -> Response:
        collect = asyncio.ensure_future(_collect(group))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():
                return Response(status_code=499)  # nobody is listening; the requests are aborted below
            try:
                outputs = collect.result()
            except EngineFailure as exc:
                raise APIError(500, str(exc), code="engine_failure") from exc
            except EngineUnavailableError as exc:
                raise APIError(503, str(exc), code="engine_unavailable") from exc
        finally:
            for task in (collect, gone):
                task.cancel()
            group.abort_unfinished()
        choices = [meta.choice(i, out) for i, out in enumerate(outputs)]
        return JSONResponse(
            {
                **meta.header(chunk=False),
                "choices": choices,
                "usage": usage([o.metrics for o in outputs]),
                **({"prompt_token_ids": outputs[0].prompt_token_ids} if meta.chat and meta.token_ids else {}),
            }
        )

    async def _stream(self, group: RequestGroup, meta: _Meta, include_usage: bool) -> AsyncIterator[dict]:
        outputs: dict[int, RequestOutput] = {}
        extra = {"usage": None} if include_usage else {}
        try:
            if meta.chat:
                first = meta.delta(0, {"role": "assistant", "content": ""})
                yield {**meta.header(chunk=True), "choices": [first], **extra}
            async for index, step in group:
                if step.output is not None:
                    outputs[index] = step.output
                if not step.new_text and step.output is None:
                    continue
                reason = finish_reason(step.output.finish_reason) if step.output else None
                if meta.chat:
                    delta = {"content": step.new_text} if step.new_text else {}
                    choice = meta.delta(index, delta, reason)
                else:
                    choice = {
                        "index": index,
                        "text": step.new_text,
                        "logprobs": None,
                        "finish_reason": reason,
                    }
                if step.output is not None and meta.token_ids:
                    choice["token_ids"] = step.output.token_ids
                    choice["prompt_token_ids"] = step.output.prompt_token_ids
                yield {**meta.header(chunk=True), "choices": [choice], **extra}
            if include_usage:
                metrics = [outputs[i].metrics for i in sorted(outputs)]
                yield {**meta.header(chunk=True), "choices": [], "usage": usage(metrics)}
        except (EngineFailure, EngineUnavailableError) as exc:
            status = 500 if isinstance(exc, EngineFailure) else 503
            yield APIError(status, str(exc)).body()
        finally:
            # Normal end: nothing is left. Client gone (this generator cancelled): abort the rest.
            group.abort_unfinished()


class _Meta:
    """What every response and chunk of one request repeats."""

    def __init__(self, request_id: str, created: int, model: str, chat: bool, token_ids: bool) -> None:
        self.request_id, self.created, self.model = request_id, created, model
        self.chat, self.token_ids = chat, token_ids

    def header(self, chunk: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    def choice(self, index: int, out: RequestOutput) -> dict[str, Any]:
        reason = finish_reason(out.finish_reason)
        if self.chat:
            choice: dict[str, Any] = {
                "index": index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": None,
                "finish_reason": reason,
            }
            if self.token_ids:
                choice["token_ids"] = out.token_ids
            return choice
        choice = {"index": index, "text": out.text, "logprobs": None, "finish_reason": reason}
        if self.token_ids:
            choice["prompt_token_ids"] = out.prompt_token_ids
            choice["token_ids"] = out.token_ids
        return choice

    def delta(self, index: int, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}


async def _collect(group: RequestGroup) -> list[RequestOutput]:
    outputs: dict[int, RequestOutput] = {}
    async for index, step in group:
        if step.output is not None:
            outputs[index] = step.output
    return [outputs[i] for i in range(len(group.request_ids))]


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away (the body has been read, so only a disconnect can come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    async for event in events:
        yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"


async def _parse(request: Request, model: type[_Body]) -> _Body:
    raw = await request.body()
    try:
        data = json.loads(raw)
        # A lone surrogate ("\ud800") parses, but no tokenizer can take it.
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def build_app(engine: Engine, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine`; the engine's thread starts and stops with the app (its lifespan)."""
    server = OpenAIServer(engine, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.engine.stop)
            # After the engine thread: nothing writes to the tiers or records events any more.
            await asyncio.to_thread(server.engine.engine.close)

    app = FastAPI(title="kvsplice", lifespan=lifespan)
    app.state.server = server
    install_handlers(app, server.metrics.error)

    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    app.add_api_route("/audit", server.audit, methods=["GET"])
    return app
