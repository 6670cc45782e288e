"""From sampled tokens to what callers see: text, stop strings, finishing.

Per request it keeps an incremental detokenizer and how much text has gone out. A token ends the
request on EOS (unless ignored), at max_tokens or the context length, or when the text contains a
stop string (the text is cut before it). Text that might be the start of a stop string is held back
until it is decided, so a streamed stop string is never shown.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsplice.engine.request import Request
from kvsplice.loader.tokenizer import IncrementalDecoder, Tokenizer
from kvsplice.outputs import RequestOutput


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request: the new tokens and text, and the output once finished."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    output: RequestOutput | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self._decoders: dict[str, IncrementalDecoder | None] = {}
        self._emitted: dict[str, int] = {}

    def add(self, request_id: str) -> None:
        self._decoders[request_id] = IncrementalDecoder(self.tokenizer) if self.tokenizer else None
        self._emitted[request_id] = 0

    def remove(self, request_id: str) -> None:
        del self._decoders[request_id], self._emitted[request_id]

    def append(self, request: Request, token: int) -> StepOutput:
        """Add a sampled token to the request's output; sets request.finish_reason when it ends it."""
        params = request.params
        request.output_ids.append(token)
        decoder = self._decoders[request.request_id]
        is_eos = token in self.eos_ids and not params.ignore_eos
        if decoder is not None and not is_eos:
            request.text += decoder.push(token)
        total = request.num_prompt_tokens + len(request.output_ids)
        if is_eos:
            request.finish_reason = "stop"
        elif len(request.output_ids) >= params.max_tokens or total >= self.max_model_len:
            request.finish_reason = "length"
        if request.finish_reason is not None and decoder is not None:
            # Bytes of a character still incomplete when generation ends.
            request.text += decoder.flush()
        cuts = [cut for stop in params.stop if (cut := request.text.find(stop)) != -1]
        if cuts:
            request.text = request.text[: min(cuts)]
            request.finish_reason = "stop"
        text = request.text
        hold = 0 if request.finish_reason else max((_overlap(text, s) for s in params.stop), default=0)
        start = self._emitted[request.request_id]
        new_text = text[start : len(text) - hold]
        self._emitted[request.request_id] = start + len(new_text)
        return StepOutput(request.request_id, (token,), new_text)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
