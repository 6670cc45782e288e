"""Request bodies (OpenAI's and vLLM's field names, plus kvsplice's extensions) and response pieces.

Fields OpenAI defines that kvsplice cannot honour (n > 1, logprobs, penalties, tools, ...) are
refused with a 400 rather than silently ignored; fields nobody defines are ignored, as vLLM does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvsplice.options import RequestOptions
from kvsplice.outputs import RequestMetrics
from kvsplice.sampling import SamplingParams
from kvsplice.server.errors import BadRequest

# torch.Generator.manual_seed accepts this range.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    # Strict types: JSON `true` is not the number 1 nor "0.5" a number, as in OpenAI's API (lax,
    # `"repair_fallback_margin": true` became 1.0, a full prefill of every spliced request).
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    user: str | None = None
    # vLLM's: return the prompt's token ids and each choice's generated ids.
    return_token_ids: bool = False
    # kvsplice's: reuse, repair and isolation.
    cache_salt: str | None = None
    repair: str | None = None
    recompute_ratio: float | None = None
    repair_fallback_margin: float | None = None
    # Prefill in full as well before answering, and say in usage how far the answer was from it.
    audit: bool = False

    def check_supported(self) -> None:
        if self.n not in (None, 1):
            raise BadRequest(f"n must be 1 (kvsplice returns one choice per prompt), got {self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise BadRequest(f"{name} is not supported", name)
        if self.repetition_penalty not in (None, 1):
            raise BadRequest("repetition_penalty is not supported", "repetition_penalty")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        if self.min_tokens:
            raise BadRequest("min_tokens is not supported", "min_tokens")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options needs stream: true", "stream_options")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise BadRequest(f"seed must be in [{_SEED_MIN}, {_SEED_MAX}]", "seed")
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens must be >= 1, got {max_tokens}", "max_tokens")
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else 16,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=() if self.stop is None else self.stop,
            ignore_eos=self.ignore_eos,
        )

    def request_options(self) -> RequestOptions:
        """Raises InvalidRequestError for a bad value (a 400 for the client)."""
        return RequestOptions(
            repair=self.repair,
            recompute_ratio=self.recompute_ratio,
            repair_fallback_margin=self.repair_fallback_margin,
            cache_salt=self.cache_salt,
            audit=self.audit,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    # A string, token ids, a list of parts, or a batch of those: see kvsplice.server.prompts.
    prompt: Any = Field(...)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise BadRequest("echo is not supported", "echo")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise BadRequest("best_of must be 1", "best_of")
        if self.logprobs is not None:
            raise BadRequest("logprobs are not supported", "logprobs")


class ChatCompletionRequest(_Common):
    messages: Any = Field(...)
    # kvsplice's: reusable documents, placed at the start of the first user message.
    documents: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise BadRequest("logprobs are not supported", "logprobs")
        if self.tools:
            raise BadRequest("tools are not supported", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise BadRequest("tool_choice is not supported", "tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise BadRequest("only response_format {'type': 'text'} is supported", "response_format")


def usage(metrics: list[RequestMetrics]) -> dict[str, Any]:
    """OpenAI's usage, with vLLM's cached_tokens and kvsplice's reuse counts (summed over a batch)."""
    prompt = sum(m.prompt_tokens for m in metrics)
    completion = sum(m.generated_tokens for m in metrics)
    prefix = sum(m.prefix_hit_tokens for m in metrics)
    segment = sum(m.segment_hit_tokens for m in metrics)
    discovered = sum(m.discovered_hit_tokens for m in metrics)
    body: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": prefix + segment + discovered},
        "prefix_hit_tokens": prefix,
        "segment_hit_tokens": segment,
        "segment_lead_tokens": sum(m.segment_lead_tokens for m in metrics),
        "discovered_hit_tokens": discovered,
        "recomputed_tokens": sum(m.recomputed_tokens for m in metrics),
        "repair_fallbacks": sum(m.repair_fallback for m in metrics),
        "store_hit_tokens": sum(sum(m.store_hit_tokens.values()) for m in metrics),
    }
    audits = [m.audit for m in metrics if m.audit is not None]
    if audits:
        # Asked for (`"audit": true`): per prompt, how far the answer was from a full prefill's.
        body["audit"] = [dataclasses.asdict(a) for a in audits]
    return body


def finish_reason(reason: str | None) -> str | None:
    return reason if reason in ("stop", "length") else None
