"""Prefix-cache keys for prompts whose KV is approximate from some point on, so that it can be reused
as a prefix all the same.

A request that splices reused KV (marked segments, or spans found without markup) has approximate KV
from its first spliced token on: every later token reads it. The prefix caches index ids: under the
plain token ids, that KV could be served to a request that expects a full prefill. Under segment
keys, the tokens before the first spliced one keep their ids (an instruction stays shared with every
other request) and every token from it on, generated tokens included, is replaced by an id of its
own, above the vocabulary, that stands for (token, a marked segment starts here, repair settings).

A path through such ids can only be matched by a request with the same tokens, the same first
spliced position, the same marked segment starts and the same repair settings: one whose own prefill
would splice the same content there and repair it the same way. Such a request may take that KV as
its prefix: it is the KV an earlier request with that prompt start computed and answered from (a chat
turn that extends the previous one reads exactly the KV the previous answer came from). Found spans
leave no mark in the keys beyond where the first one starts: the next turn finds the same content
with other boundaries (what was new last time is in the store now), and it still matches.

Keys are a function of the start only, so a hit can end inside a segment that merely starts like a
cached one (two documents that both start "The ..."); the reuse path stores that segment all the same.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import NamedTuple

from kvsplice.prompt import ParsedPrompt

# Repair settings remembered at once. A client that sends a new setting with every request (a ratio
# of its own each time) would otherwise grow the table without bound on a long-running server.
MAX_SETTINGS = 64


class SegmentKeys:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        # Repair settings -> serial number, least recently used first. A key id is a function of
        # (token, a marked segment starts here, serial), so no table grows with the tokens. Serial
        # numbers are never reused: settings that come back after being forgotten get a new one, and
        # the paths cached under the old one are never matched again (a miss, never the wrong KV).
        self._serials: OrderedDict[Hashable, int] = OrderedDict()
        self._next_serial = 0

    def __call__(self, prompt: ParsedPrompt, settings: Hashable, first: int) -> list[int]:
        """The prompt's keys when its KV is approximate from position `first` on."""
        starts = {span.start for span in prompt.segments}
        serial = self._serial(settings)
        keys = list(prompt.token_ids)
        for i in range(first, len(keys)):
            keys[i] = self._id(keys[i], i in starts, serial)
        return keys

    def generated(self, token: int, settings: Hashable) -> int:
        """The key of a token a segment-keyed request generated."""
        return self._id(token, False, self._serial(settings))

    @property
    def num_settings(self) -> int:
        """Repair settings remembered now (at most MAX_SETTINGS)."""
        return len(self._serials)

    def _serial(self, settings: Hashable) -> int:
        serial = self._serials.get(settings)
        if serial is None:
            serial = self._serials[settings] = self._next_serial
            self._next_serial += 1
            if len(self._serials) > MAX_SETTINGS:
                self._serials.popitem(last=False)
        self._serials.move_to_end(settings)
        return serial

    def _id(self, token: int, starts: bool, serial: int) -> int:
        """An id above the vocabulary, distinct for every (token, starts, serial): the vocabulary-sized
        range of ids (serial, starts) owns, at the token's place in it."""
        assert 0 <= token < self.vocab_size
        key = self.vocab_size * (1 + 2 * serial + starts) + token
        # The hash-chain cache packs ids as int64.
        assert key < 2**63, "segment key ids exhausted"
        return key

    def choose(
        self,
        prompt: ParsedPrompt,
        settings: Hashable,
        approximate: bool,
        peek: Callable[[list[int]], int],
        first_found: int | None = None,
        exact_lead: int | None = None,
    ) -> CacheKeys:
        """The ids a request is cached under: plain token ids, or segment keys when the request splices
        with a repair that leaves KV approximate and they match at least as much (`peek`: the prefix
        cache's hit for some ids): then its KV, approximate or not, enters the prefix cache under them
        and later requests that extend it reuse it. `first_found`: where the first span found without
        markup after the plain prefix hit starts, if any (reuse/path.Lookup). `exact_lead`: where
        the prompt's first marked segment ends when it will be spliced from lead KV computed after
        this very head (a full prefill's KV): its tokens keep their ids, and segment keys start after
        it. Else a request that opens with the same segment and asks another question would take, as its
        prefix, this one's KV of it, repaired for this one's question, which is further from a full
        prefill than splicing it afresh (docs/design.md)."""
        plain = list(prompt.token_ids)
        if not approximate:
            return CacheKeys(plain, None)
        plain_hit = peek(plain)
        starts = [span.start for span in prompt.segments]
        if exact_lead is not None:
            assert prompt.segments and prompt.segments[0].end == exact_lead
            starts = starts[1:]
        if first_found is not None:
            assert first_found >= plain_hit, "spans are found after the plain prefix hit"
            starts.append(first_found)
        if not starts:
            return CacheKeys(plain, None)
        first = min(starts)
        keys = self(prompt, settings, first)
        if peek(keys) >= plain_hit:
            return CacheKeys(keys, first)
        return CacheKeys(plain, None)


class CacheKeys(NamedTuple):
    ids: list[int]
    # Where segment keys start (the first spliced position the request may have); None: plain ids.
    approximate_from: int | None
