"""The offline Python API: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

from kvsplice.config import EngineConfig
from kvsplice.engine.engine import Engine
from kvsplice.errors import InvalidRequestError
from kvsplice.options import RequestOptions
from kvsplice.outputs import RequestOutput
from kvsplice.prompt import Prompt, Segment, is_token_ids
from kvsplice.sampling import SamplingParams


class LLM:
    """An engine in this process. `LLM()` runs the default model; keyword arguments are EngineConfig's.

    What the engine owes the tiers below the pool (segments whose copy is queued, writes in flight) is
    written when the LLM is closed: by `close()`, at the end of a `with LLM(...) as llm:` block, when
    the object is garbage-collected, or at interpreter exit, whichever comes first. A process killed
    outright (SIGKILL, a crash) loses what was not written yet: the new segments of the requests since
    its last `generate` began (their copies run in the engine's next steps) and writes in flight."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = Engine(self.config)
        self.tokenizer = self.engine.tokenizer
        # Runs engine.close once: at close(), on collection or at exit (weakref.finalize's atexit hook).
        self._closer = weakref.finalize(self, self.engine.close)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | None = None,
        options: RequestOptions | Sequence[RequestOptions] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts.

        `prompts` is one prompt or a list of them. A prompt is a string, a list of token ids (used
        verbatim), or a list of parts (strings, token-id lists, `Segment`s); a lone list of parts
        must be wrapped in a list unless it contains a Segment. `options` (repair policy and budget,
        cache salt) apply to every prompt, or give one per prompt. Every prompt is validated before
        any runs, so a bad one raises and nothing else is lost.
        """
        params = sampling_params or SamplingParams()
        batch = _as_batch(prompts)
        per_prompt = _per_prompt(options, len(batch))
        engine = self.engine
        ids: list[str] = []
        try:
            for prompt, opts in zip(batch, per_prompt, strict=True):
                ids.append(engine.add_request(prompt, params, opts))
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

    def close(self) -> None:
        """Finish writing segments to the tiers below the pool and stop publishing KV events (again:
        nothing)."""
        self._closer()


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise InvalidRequestError("generate() needs a prompt or a non-empty list of prompts")
    if is_token_ids(prompts):
        return [prompts]  # type: ignore[list-item]
    if any(isinstance(p, Segment) for p in prompts):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]


def _per_prompt(options: RequestOptions | Sequence[RequestOptions] | None, n: int) -> list[RequestOptions]:
    if options is None or isinstance(options, RequestOptions):
        return [options or RequestOptions()] * n
    each = list(options)
    if len(each) != n or not all(isinstance(o, RequestOptions) for o in each):
        raise InvalidRequestError(f"options: one RequestOptions, or one per prompt ({n}); got {len(each)}")
    return each
