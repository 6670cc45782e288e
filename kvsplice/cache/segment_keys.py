"""Prefix-cache keys for prompts with segments, so that a request's spliced KV can be reused as a prefix.

A spliced request's KV is approximate from its first reused segment on, and the prefix caches index
token ids: under its plain token ids, that KV could be served to a request that expects a full
prefill. Under segment keys, every token inside a segment is replaced by an id of its own, above the
vocabulary, that stands for (token, first of its segment or not, repair settings). A path through
such ids can only be matched by a request with the same prompt start, the same segment markup and the
same repair settings: one whose own prefill would splice and repair the same segments at the same
places. Such a request may take that KV as its prefix: it is the KV an earlier request with that
prompt start computed and answered from (a chat turn that extends the previous one reads exactly the
KV the previous answer came from). Plain tokens keep their ids, so an instruction before the first
segment stays shared with every other request; tokens after a segment keep theirs too, and are told
apart by the path they hang on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple

from kvsplice.prompt import ParsedPrompt


class SegmentKeys:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # (token, first of its segment, repair settings) -> key id; ids are handed out in order, so two
        # different triples never share one (a hash could collide and serve the wrong KV).
        self._ids: dict[tuple[int, bool, Hashable], int] = {}

    def __call__(self, prompt: ParsedPrompt, settings: Hashable) -> list[int]:
        keys = list(prompt.token_ids)
        for span in prompt.segments:
            for i in range(span.start, span.end):
                keys[i] = self._id((keys[i], i == span.start, settings))
        return keys

    def _id(self, triple: tuple[int, bool, Hashable]) -> int:
        key = self._ids.get(triple)
        if key is None:
            key = self._ids[triple] = self.vocab_size + len(self._ids)
        return key

    def choose(
        self, prompt: ParsedPrompt, settings: Hashable, approximate: bool, peek: Callable[[list[int]], int]
    ) -> CacheKeys:
        """The ids a request is cached under: plain token ids, or segment keys when the request splices
        with a repair that leaves KV approximate and they match at least as much (`peek`: the prefix
        cache's hit for some ids): then its KV, approximate or not, enters the prefix cache under them
        and later requests that extend it reuse it."""
        plain = list(prompt.token_ids)
        if not prompt.segments or not approximate:
            return CacheKeys(plain, False)
        keys = self(prompt, settings)
        if peek(keys) >= peek(plain):
            return CacheKeys(keys, True)
        return CacheKeys(plain, False)


class CacheKeys(NamedTuple):
    ids: list[int]
    # The ids are segment keys: all of the request's KV may be indexed, approximate or not.
    segment_keyed: bool
