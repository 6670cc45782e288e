"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.errors import InvalidRequestError
from kvsplice.outputs import RequestOutput
from kvsplice.prompt import Prompt, Segment
from kvsplice.sampling import SamplingParams


class LLM:
    """An engine in this process. `LLM()` runs the default model; keyword arguments are EngineConfig's."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        *,
        cache_salt: str | Sequence[str | None] | None = None,
        repair: str | None = None,
        recompute_ratio: float | None = None,
        recompute_tokens: int | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts.

        `prompts` is one prompt or a list of them. A prompt is a string, a list of token ids (used
        verbatim), or a list of parts (strings, token-id lists, `Segment`s); a lone list of parts
        must be wrapped in a list unless it contains a Segment. Every prompt is validated before
        any runs, so a bad one raises and nothing else is lost.
        """
        params = sampling_params or SamplingParams()
        batch = _as_batch(prompts)
        salts = _per_prompt(cache_salt, len(batch))
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, salt in zip(batch, salts, strict=True):
                ids.append(
                    engine.add_request(
                        prompt,
                        params,
                        cache_salt=salt,
                        repair=repair,
                        recompute_ratio=recompute_ratio,
                        recompute_tokens=recompute_tokens,
                    )
                )
        except Exception:
            for request_id in ids:
                engine.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for step in engine.step():
                if step.output is not None:
                    done[step.request_id] = step.output
        return [done[i] for i in ids]


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError("generate() needs a prompt or a non-empty list of prompts")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # type: ignore[list-item]
    if any(isinstance(p, Segment) for p in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(salt: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if salt is None or isinstance(salt, str):
        return [salt] * n
    salts = list(salt)
    if len(salts) != n:
        raise InvalidRequestError(f"{len(salts)} cache salts for {n} prompts")
    return salts
