"""Prompts: a string, a list of token ids, or a list of parts in which `Segment`s mark reusable content.

Parts are tokenised one by one and concatenated, so a segment's tokens never depend on its
neighbours: the same document gives the same tokens wherever it sits, which is what lets its KV be
found again. BOS is added once, at the start, when the model expects one (a plain token-id prompt is
used verbatim).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvsplice.errors import InvalidRequestError


@dataclass(frozen=True)
class Segment:
    """Content whose KV may be reused wherever it appears: text, or token ids."""

    content: str | tuple[int, ...] | list[int]

    def __post_init__(self) -> None:
        if isinstance(self.content, list):
            object.__setattr__(self, "content", tuple(self.content))
        if isinstance(self.content, str):
            if not self.content:
                raise InvalidRequestError("a Segment's text is empty")
        elif not is_token_ids(self.content):
            raise InvalidRequestError("a Segment's content must be non-empty text or a list of token ids")


Part = str | Sequence[int] | Segment
Prompt = str | Sequence[int] | Sequence[Part]


@dataclass(frozen=True)
class SegmentSpan:
    """Where a segment's tokens sit in the prompt: positions [start, end)."""

    start: int
    end: int


@dataclass(frozen=True)
class ParsedPrompt:
    token_ids: tuple[int, ...]
    segments: tuple[SegmentSpan, ...] = ()

    def segment_tokens(self, span: SegmentSpan) -> tuple[int, ...]:
        return self.token_ids[span.start : span.end]


class Encoder(Protocol):
    bos_token_id: int | None
    add_bos: bool

    def encode(self, text: str) -> list[int]: ...


def parse_prompt(prompt: Prompt, tokenizer: Encoder | None, vocab_size: int) -> ParsedPrompt:
    if isinstance(prompt, str):
        ids = bos_ids(tokenizer) + _encode(prompt, tokenizer)
        parsed = ParsedPrompt(tuple(ids))
    elif isinstance(prompt, Sequence) and prompt and all(is_token(t) for t in prompt):
        parsed = ParsedPrompt(tuple(prompt))  # type: ignore[arg-type]
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        parsed = _parse_parts(prompt, tokenizer)  # type: ignore[arg-type]
    else:
        raise InvalidRequestError(
            f"a prompt must be a string, token ids or a list of parts, got {type(prompt)}"
        )
    if not parsed.token_ids:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in parsed.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
    return parsed


def _parse_parts(parts: Sequence[Part], tokenizer: Encoder | None) -> ParsedPrompt:
    ids: list[int] = bos_ids(tokenizer)
    spans = []
    for part in parts:
        if isinstance(part, Segment):
            content = part.content
            tokens = _encode(content, tokenizer) if isinstance(content, str) else [int(t) for t in content]
            if tokens:
                spans.append(SegmentSpan(len(ids), len(ids) + len(tokens)))
            ids += tokens
        elif isinstance(part, str):
            ids += _encode(part, tokenizer)
        elif isinstance(part, Sequence) and all(is_token(t) for t in part):
            ids += [int(t) for t in part]
        else:
            raise InvalidRequestError(
                f"a prompt part must be a string, token ids or a Segment, got {part!r:.80}"
            )
    return ParsedPrompt(tuple(ids), tuple(spans))


def is_token(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def is_token_ids(value: object) -> bool:
    """A non-empty list or tuple of token ids (ints, not bools)."""
    return isinstance(value, list | tuple) and bool(value) and all(is_token(t) for t in value)


def _encode(text: str, tokenizer: Encoder | None) -> list[int]:
    if tokenizer is None:
        raise InvalidRequestError("this model has no tokenizer; pass token ids instead of text")
    return tokenizer.encode(text)


def bos_ids(tokenizer: Encoder | None) -> list[int]:
    """The BOS rule, in one place: [BOS] when the model expects one at the start of a prompt, else []."""
    if tokenizer is not None and tokenizer.add_bos and tokenizer.bos_token_id is not None:
        return [tokenizer.bos_token_id]
    return []
