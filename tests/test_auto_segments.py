"""Reuse without markup (auto_segments): the span finder against the segment store, then the engine on
the default model with plain-string prompts that carry the same passages in another order."""

from __future__ import annotations

import random

import pytest
import torch

from kvsplice import LLM, SamplingParams, Segment
from kvsplice.cache.base import CacheSeq
from kvsplice.cache.registry import make_prefix_cache
from kvsplice.cache.segments import SegmentStore
from kvsplice.cli import build_parser
from kvsplice.config import EngineConfig
from kvsplice.kv.allocator import BlockAllocator
from kvsplice.options import RequestOptions
from kvsplice.reuse.discover import SpanFinder
from tests.test_splice_default import DOCS, QUESTION

# -- the finder, without a model ------------------------------------------------------------------


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50000) for _ in range(n)]


def _finder() -> tuple[SpanFinder, SegmentStore]:
    store = SegmentStore(BlockAllocator(256, 16), ())
    finder = SpanFinder(min_tokens=64, history_tokens=10_000, seam_tokens=2)
    store.watch(finder)
    return finder, store


def test_a_passage_seen_before_is_new_then_stored_is_reused_from_any_offset() -> None:
    finder, store = _finder()
    a, b, filler = _tokens(150, 1), _tokens(120, 2), _tokens(40, 3)
    finder.remember("ns", [*filler, *a, *b])
    prompt = [*b, *filler, *a, *filler]
    found = finder.find("ns", prompt, [])
    # b, and filler + a (side by side in both), are found against the earlier prompt, each cut 2 tokens
    # inside where it meets other text (b starts the prompt: no seam there).
    assert [(s.start, s.end) for s in found.new] == [(0, 118), (122, 308)]
    assert found.new[1].earlier == [*filler, *a][:188] and not found.reused
    for s in found.new:
        blocks = store.allocator.allocate(-(-(s.end - s.start) // 16))
        store.insert("ns", tuple(prompt[s.start : s.end]), blocks)
    # Stored: a later prompt reuses that entry from an offset (its first tokens are covered by markup).
    later = [*filler, *a[:-10], *filler]
    found = finder.find("ns", later, [(0, 50)])
    assert not found.new and len(found.reused) == 1
    span = found.reused[0]
    assert (span.start, span.end, span.offset) == (50, 180, 48) and span.tokens == (*filler[2:], *a[:-2])
    length = span.end - span.start
    assert later[span.start : span.end] == list(span.tokens[span.offset : span.offset + length])


def test_an_unwatched_watcher_hears_of_no_later_insert() -> None:
    store = SegmentStore(BlockAllocator(16, 16), ())
    heard = _Inserted()
    store.watch(heard)
    store.insert("ns", tuple(_tokens(16, 1)), store.allocator.allocate(1))
    store.unwatch(heard)
    store.insert("ns", tuple(_tokens(16, 2)), store.allocator.allocate(1))
    assert heard.entries == [tuple(_tokens(16, 1))]
    with pytest.raises(AssertionError):
        store.unwatch(heard)


def test_namespaces_never_cross_and_evicted_entries_are_forgotten() -> None:
    finder, store = _finder()
    a = _tokens(200, 4)
    finder.remember("tenant-a", a)
    assert finder.find("tenant-b", [7, *a], []) == ([], [])
    store.insert("tenant-a", tuple(a), store.allocator.allocate(13))
    assert finder.find("tenant-a", [7, *a, 7], [])[0]
    store.clear()
    assert not finder.find("tenant-a", [7, *a, 7], [])[0] and len(finder.stored) == 0


def test_spans_shorter_than_the_minimum_and_the_prompts_tail_are_left_alone() -> None:
    finder, _ = _finder()
    a = _tokens(120, 5)
    finder.remember("ns", a)
    assert finder.find("ns", [*a[:63], *_tokens(40, 6)], []) == ([], [])
    # The last `tail` tokens are always computed: a passage that ends the prompt is found without them,
    # and one that would be long enough only with them is not found.
    tail = finder.tail_tokens
    (span,) = finder.find("ns", [9, 9, *a], []).new
    assert (span.start, span.end) == (4, 122 - tail)
    assert finder.find("ns", [9, 9, *a[: 64 + tail]], []) == ([], [])
    assert finder.find("ns", [9, 9, *a[: 66 + tail]], []).new


@pytest.mark.parametrize(("kind", "hit"), [("radix", 10), ("hash", 8), ("off", 0)])
def test_borrow_references_an_earlier_prompts_blocks(kind: str, hit: int) -> None:
    """A found span's KV is read from the prefix cache's blocks of the earlier prompt that carried it."""
    alloc = BlockAllocator(16, 4)
    cache = make_prefix_cache(kind, alloc)
    tokens = list(range(100, 118))
    seq = CacheSeq("r", "ns", tokens)
    cache.acquire(seq)
    seq.block_table, seq.num_computed = alloc.allocate(5), len(tokens)
    cache.on_computed(seq)
    table = list(seq.block_table)
    cache.release(seq)
    refs = [alloc.ref(b) for b in table]
    borrowed = cache.borrow("ns", tokens[:10])
    assert borrowed.num_tokens == hit and list(borrowed.blocks) == table[: -(-hit // 4)]
    assert [alloc.ref(b) - r for b, r in zip(table, refs, strict=True)] == [
        int(b in borrowed.blocks) for b in table
    ]
    assert cache.borrow("other", tokens).num_tokens == 0
    alloc.decref(borrowed.blocks)
    alloc.check_invariants()


def test_the_switch_is_on_by_default_and_off_from_the_command_line() -> None:
    parser = build_parser()
    assert EngineConfig.from_args(parser.parse_args(["serve"])).auto_segments
    assert not EngineConfig.from_args(parser.parse_args(["serve", "--no-auto-segments"])).auto_segments


# -- the engine, on the default model -------------------------------------------------------------

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, return_first_logits=True)
INSTRUCTION = "Answer from the documents.\n\n"


def _plain(order: list[int]) -> str:
    return INSTRUCTION + "".join(DOCS[i] + "\n\n" for i in order) + QUESTION


def _marked(order: list[int]) -> list:
    return [INSTRUCTION, *(p for i in order for p in (Segment(DOCS[i]), "\n\n")), QUESTION]


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float(torch.sum(p.softmax(-1) * (p.log_softmax(-1) - q.log_softmax(-1))))


@pytest.fixture(scope="module")
def auto(default_model_dir) -> LLM:
    """auto_segments on (the default), over the radix prefix cache."""
    return LLM(kv_cache_gb=0.25)


@pytest.mark.slow
def test_plain_prompts_reuse_the_passages_like_marked_segments(auto: LLM, llm: LLM) -> None:
    want = llm.generate(_plain([2, 0, 1]), PARAMS)[0]
    got: dict[str, dict[str, torch.Tensor | int | list[int]]] = {}
    for salt, prompt in (("plain", _plain), ("marked", _marked)):
        auto.generate([prompt([0, 1, 2])], PARAMS, RequestOptions(cache_salt=salt))
        for repair in ("boundary", "full"):
            out = auto.generate([prompt([2, 0, 1])], PARAMS, RequestOptions(repair, cache_salt=salt))[0]
            m = out.metrics
            reused = m.prefix_hit_tokens + m.segment_hit_tokens + m.discovered_hit_tokens
            assert reused + m.computed_tokens == m.prompt_tokens
            got[f"{salt} {repair}"] = {
                "logits": out.first_logits,
                "found": m.discovered_hit_tokens,
                "marked": m.segment_hit_tokens,
                "ids": out.token_ids,
            }
    assert got["marked boundary"]["found"] == 0
    plain, marked = got["plain boundary"], got["marked boundary"]
    # Unmarked, the second request already reuses nearly what markup gives (~120 tokens a passage), but
    # for the first tokens of each of the three found passages and the prompt's last tokens, computed.
    assert auto.engine.reuse.finder is not None
    heads = 3 * auto.engine.reuse.finder.head_tokens
    assert plain["marked"] == 0 and plain["found"] + heads >= 0.9 * marked["marked"]  # type: ignore[operator]
    # The full repair reproduces the full prefill through discovered spans, as through marked ones.
    torch.testing.assert_close(got["plain full"]["logits"], want.first_logits, atol=2e-3, rtol=1e-3)
    assert got["plain full"]["ids"] == want.token_ids
    # The default repair: about as close to the full prefill as with markup (0.022 and 0.019 measured).
    kl_plain = _kl(want.first_logits, plain["logits"])  # type: ignore[arg-type]
    kl_marked = _kl(want.first_logits, marked["logits"])  # type: ignore[arg-type]
    assert kl_plain <= 1.5 * kl_marked + 0.01, (kl_plain, kl_marked)


@pytest.mark.slow
def test_salts_never_cross(auto: LLM) -> None:
    auto.generate(_plain([1, 0, 2]), PARAMS, RequestOptions(cache_salt="tenant-a"))
    other = auto.generate(_plain([0, 2, 1]), PARAMS, RequestOptions(cache_salt="tenant-b"))[0]
    assert other.metrics.discovered_hit_tokens == 0
    same = auto.generate(_plain([0, 2, 1]), PARAMS, RequestOptions(cache_salt="tenant-a"))[0]
    assert same.metrics.discovered_hit_tokens > 0


@pytest.mark.slow
def test_auto_segments_off_reuses_only_the_prefix(default_model_dir) -> None:
    off = LLM(kv_cache_gb=0.25, auto_segments=False)
    off.generate(_plain([0, 1, 2]), PARAMS)
    m = off.generate(_plain([2, 0, 1]), PARAMS)[0].metrics
    assert m.discovered_hit_tokens == 0 and m.segment_hit_tokens == 0
    assert m.computed_tokens == m.prompt_tokens - m.prefix_hit_tokens and len(off.engine.segment_store) == 0


@pytest.mark.slow
def test_the_next_turn_of_a_plain_prompt_takes_the_spliced_turn_as_its_prefix(auto: LLM) -> None:
    options = RequestOptions(cache_salt="turns")
    auto.generate(_plain([0, 1, 2]), PARAMS, options)
    first = auto.generate(_plain([2, 0, 1]), PARAMS, options)[0]
    assert first.metrics.discovered_hit_tokens > 0
    assert auto.tokenizer is not None
    follow_up = auto.tokenizer.encode("\nQuestion: Where is it?\nAnswer:")
    turn = [*first.prompt_token_ids, *first.token_ids, *follow_up]
    m = auto.generate([turn], PARAMS, options)[0].metrics
    # The whole earlier turn, spliced KV and the answer read from it, is this turn's prefix (under
    # segment keys that start where the first span was found); before, the hit stopped at that span
    # and the passages were found, spliced and repaired again.
    assert m.prefix_hit_tokens >= len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert m.discovered_hit_tokens == 0


@pytest.mark.slow
def test_a_span_found_before_a_marked_segment_never_reaches_a_plain_prefix(auto: LLM, llm: LLM) -> None:
    options = RequestOptions(cache_salt="mixed")
    auto.generate(_plain([1, 0]), PARAMS, options)
    mixed = [INSTRUCTION, DOCS[0] + "\n\n", Segment(DOCS[2]), "\n\n" + QUESTION]
    spliced = auto.generate([mixed], PARAMS, options)[0]
    assert spliced.metrics.discovered_hit_tokens > 0 and spliced.metrics.segment_hit_tokens == 0
    # The same text, plain, with an exact repair: whatever it takes from the prefix cache is exact.
    text = INSTRUCTION + DOCS[0] + "\n\n" + DOCS[2] + "\n\n" + QUESTION
    exact = auto.generate([text], PARAMS, RequestOptions("full", cache_salt="mixed"))[0]
    want = llm.generate([text], PARAMS)[0]
    torch.testing.assert_close(exact.first_logits, want.first_logits, atol=2e-3, rtol=1e-3)


class _Inserted:
    """Records the entries the segment store gains."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, ...]] = []

    def inserted(self, namespace: object, tokens: tuple[int, ...]) -> None:
        self.entries.append(tokens)

    def evicted(self, namespace: object, tokens: tuple[int, ...]) -> None:
        pass


@pytest.mark.slow
def test_a_new_passage_right_before_a_found_one_is_stored_without_the_found_ones_head(auto: LLM) -> None:
    options = RequestOptions(cache_salt="gap")
    auto.generate(_plain([0, 1]), PARAMS, options)
    watch = _Inserted()
    store = auto.engine.segment_store
    store.watch(watch)
    # Passages 1 and 0 are found (their first tokens computed); passage 2, between them, is new: it is
    # computed after spliced KV, so the store keeps it (the prefix cache will not).
    try:
        m = auto.generate(_plain([1, 2, 0]), PARAMS, options)[0].metrics
    finally:
        store.unwatch(watch)
    assert m.discovered_hit_tokens > 0 and len(watch.entries) >= 3
    head = auto.engine.reuse.finder.head_tokens  # type: ignore[union-attr]
    # The found span's entry holds its head; no other entry ends with those tokens again.
    for a in watch.entries:
        for b in watch.entries:
            assert a is b or a[-head:] != b[:head], "a computed stretch was stored with a found span's head"
