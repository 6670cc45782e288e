"""The `recall` workload: multi-document fact recall, built not to flatter a reuse system.

Per setting (4, 8 and 12 documents per request by default), a pool of synthetic documents of about
100 to 500 tokens, each holding one fact of every kind (an access code, a keeper, a port, a door
colour, an emblem) about a site of its own, planted among encyclopedia sentences. A request asks one
fact, so its answer sits among k - 1 facts of the same kind about other sites. The asked document is
first, middle or last in the request in equal shares. Warm-up requests carry every pool document
once; each measured request carries them again in an order no earlier request had.

The prompt ends inside the answer sentence ("Answer: The keeper of the Harlow depot is"), so the first
generated token is the answer's own first token: first-token agreement and KL measure the answer,
not a space or a preamble. A continuation is correct only if it starts with the answer.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvsplice.bench import corpus as corpora
from kvsplice.bench.base import BenchRequest, Doc, Part, Workload, WorkloadSpec, warmup_orders

T = TypeVar("T")

INSTRUCTION = "Read the documents below and answer the question.\n\n"
POSITIONS = ("first", "middle", "last")
# A document's filler is cut to between this share of `doc_words` and `doc_words` words.
MIN_FILLER_SHARE = 0.2
_SITE_TYPES = [
    "depot", "mill", "lighthouse", "warehouse", "station", "workshop", "quarry", "dock", "foundry",
    "brewery", "tannery", "granary", "boathouse", "forge", "bakery", "sawmill", "dairy", "ropewalk",
]  # fmt: skip
_ONSETS = ["b", "br", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "th", "v", "w"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "ou"]
_CODAS = ["", "l", "n", "r", "s", "rk", "nd", "m", "th"]
_ENDINGS = ["ow", "ey", "wick", "moor", "ford", "dale", "stead", "ham"]
# The values of the kinds other than codes: each one token after a space in Gemma 3's tokenizer, none
# in the synthetic corpus, no two kinds sharing one (a test checks all three). Animals start with a
# consonant, so the "a" before them never hints at the answer (as "an" would).
_KEEPERS = [
    "Marta", "Oscar", "Hugo", "Elena", "Ivan", "Nina", "Victor", "Clara", "Felix", "Laura", "Pablo",
    "Sofia", "Anton", "Greta", "Omar", "Rosa", "Bruno", "Alice", "Diego", "Ingrid", "Karl", "Lucia",
    "Nadia", "Otto", "Paula", "Rita", "Simon", "Tomas", "Vera", "Walter", "Zara", "Boris", "Carmen",
    "Dora",
]  # fmt: skip
_PORTS = [
    "Lisbon", "Oslo", "Vienna", "Cairo", "Dublin", "Madrid", "Prague", "Warsaw", "Athens", "Berlin",
    "Paris", "London", "Tokyo", "Seoul", "Lima", "Nairobi", "Boston", "Denver", "Geneva", "Naples",
    "Munich", "Hamburg", "Chicago", "Sydney", "Toronto", "Delhi", "Mumbai", "Moscow", "Rome", "Venice",
    "Bangkok", "Manila", "Havana", "Dallas",
]  # fmt: skip
_COLOURS = [
    "red", "blue", "green", "yellow", "orange", "purple", "black", "white", "grey", "pink", "brown",
    "violet", "crimson", "scarlet", "teal", "amber", "ivory", "indigo", "maroon", "navy", "olive",
    "beige", "turquoise", "lavender", "magenta", "cyan", "tan", "cream", "bronze", "khaki", "lilac",
    "mauve", "burgundy", "emerald",
]  # fmt: skip
_ANIMALS = [
    "fox", "wolf", "hawk", "horse", "lion", "stag", "swan", "goat", "crow", "deer", "hare", "mole",
    "moth", "bee", "bull", "boar", "cat", "dog", "duck", "frog", "hen", "lamb", "mouse", "pig", "rat",
    "snake", "tiger", "toad", "trout", "whale", "zebra", "camel", "crane", "dove", "falcon", "goose",
]  # fmt: skip


@dataclass(frozen=True)
class FactKind:
    name: str
    # The fact sentence up to its value, with {site}; the prompt's answer line repeats it.
    lead: str
    question: str
    # The values a pool draws from; empty: 4-digit codes, drawn per pool.
    values: tuple[str, ...] = ()

    @property
    def digits(self) -> bool:
        return not self.values

    def sentence(self, site: str, value: str) -> str:
        return f"{self.lead.format(site=site)} {value}."

    def prompt(self, site: str) -> str:
        # Gemma 3 splits digits and writes " 4721" as a bare space, then digits: the space belongs to
        # the prompt, so the first generated token is the first digit. A word keeps its space.
        return self.lead.format(site=site) + (" " if self.digits else "")

    def first_token(self, value: str) -> str:
        """What the first generated token of the answer is: a code's first digit, else the word."""
        return value[0] if self.digits else value


KINDS = (
    FactKind("code", "The access code of the {site} is", "What is the access code of the {site}?"),
    FactKind(
        "keeper",
        "The keeper of the {site} is",
        "Who is the keeper of the {site}?",
        tuple(_KEEPERS),
    ),
    FactKind(
        "port",
        "The {site} ships its goods to",
        "Where does the {site} ship its goods?",
        tuple(_PORTS),
    ),
    FactKind(
        "colour",
        "The doors of the {site} are painted",
        "What colour are the doors of the {site}?",
        tuple(_COLOURS),
    ),
    FactKind(
        "emblem",
        "The emblem of the {site} is a",
        "What animal is the emblem of the {site}?",
        tuple(_ANIMALS),
    ),
)
# A pool gives every document its own value of each kind.
MAX_POOL = min(len(k.values) for k in KINDS if not k.digits)


@dataclass(frozen=True)
class _Pool:
    """One setting's documents: their sites and their value of each kind."""

    docs: list[Doc]
    sites: list[str]
    values: dict[str, list[str]]


def recall(spec: WorkloadSpec) -> Workload:
    assert spec.doc_counts and spec.pool and spec.requests and spec.doc_words
    for k in spec.doc_counts:
        if not 3 <= k <= spec.pool:
            raise ValueError(f"recall needs 3 to pool ({spec.pool}) documents per request, got {k}")
    if spec.pool > MAX_POOL:
        raise ValueError(f"recall's pool holds at most {MAX_POOL} documents, got {spec.pool}")
    warm: list[BenchRequest] = []
    measured: list[list[BenchRequest]] = []
    for k in spec.doc_counts:
        # One generator per setting: a setting's requests do not depend on which others run.
        w, m = _setting(spec, k, random.Random(f"recall:{spec.seed}:{k}"))
        warm += w
        measured.append(m)
    # Settings take turns, so that drift over a long run weighs on all of them alike.
    interleaved = [r for turn in zip(*measured, strict=True) for r in turn]
    counts = ", ".join(str(k) for k in spec.doc_counts)
    return Workload(
        "recall",
        spec,
        tuple(warm + interleaved),
        "synthetic",
        f"{counts} documents per request (one setting each), drawn from a pool of {spec.pool} per "
        "setting; every document holds one fact of each of "
        f"{len(KINDS)} kinds ({', '.join(k.name for k in KINDS)}) about its own site, so the asked fact "
        "has a same-kind distractor in every other document; the answer document is first, middle or "
        "last in equal shares, and the prompt ends where the answer begins",
    )


def _setting(spec: WorkloadSpec, k: int, rng: random.Random) -> tuple[list[BenchRequest], list[BenchRequest]]:
    assert spec.pool and spec.requests and spec.doc_words
    pool = _pool(spec.pool, spec.doc_words, k, rng)
    warm_draws = warmup_orders(spec.pool, k, rng)
    warm = [_request(f"recall-{k}-w{i}", k, pool, draw, None) for i, draw in enumerate(warm_draws)]
    seen = {tuple(d) for d in warm_draws}
    measured = []
    positions, kinds = _balanced(POSITIONS, spec.requests, rng), _balanced(KINDS, spec.requests, rng)
    for i, (position, kind) in enumerate(zip(positions, kinds, strict=True)):
        index = 0 if position == "first" else k - 1 if position == "last" else rng.choice(_middle(k))
        draw = _draw(pool, k, kind, index, seen, rng)
        measured.append(_request(f"recall-{k}-{i}", k, pool, draw, (kind, index, position)))
    return warm, measured


def _request(
    request_id: str, k: int, pool: _Pool, draw: list[int], asked: tuple[FactKind, int, str] | None
) -> BenchRequest:
    """A warm-up request (asked None: the question asks the first document's code) or a measured one."""
    kind, index, position = asked or (KINDS[0], 0, "")
    gold = draw[index]
    site = pool.sites[gold]
    question = f"Question: {kind.question.format(site=site)}\nAnswer: {kind.prompt(site)}"
    parts: tuple[Part, ...] = (INSTRUCTION, *(pool.docs[j] for j in draw), question)
    return BenchRequest(
        request_id,
        parts,
        warmup=asked is None,
        answers=(pool.values[kind.name][gold],),
        answer_doc=pool.docs[gold].key,
        setting=f"{k} docs",
        answer_position=position,
        answer_at_start=True,
    )


def _middle(k: int) -> list[int]:
    """The central position(s) of k: one for odd k, two for even k."""
    return sorted({(k - 1) // 2, k // 2})


def _balanced(items: Sequence[T], n: int, rng: random.Random) -> list[T]:
    """n items in shuffled blocks of all of them: every count is within one of the others."""
    out: list[T] = []
    while len(out) < n:
        block = list(items)
        rng.shuffle(block)
        out += block
    return out[:n]


def _draw(
    pool: _Pool, k: int, kind: FactKind, index: int, seen: set[tuple[int, ...]], rng: random.Random
) -> list[int]:
    """k pool documents in an order no earlier request had, whose document at `index` holds the only
    value of `kind` in the request that starts with its first token (codes can share a first digit)."""
    values = pool.values[kind.name]
    for _attempt in range(1000):
        draw = rng.sample(range(len(pool.docs)), k)
        if tuple(draw) in seen:
            continue
        firsts = [kind.first_token(values[j]) for j in draw]
        if firsts.count(firsts[index]) == 1:
            seen.add(tuple(draw))
            return draw
    raise ValueError(
        f"cannot draw a new order of {k} of {len(pool.docs)} documents for a {kind.name} question"
    )


def _pool(n: int, doc_words: int, k: int, rng: random.Random) -> _Pool:
    passages = corpora.load("synthetic").passages
    fillers = [
        corpora.trim(passages[i].text, rng.randint(max(1, int(doc_words * MIN_FILLER_SHARE)), doc_words))
        for i in rng.sample(range(len(passages)), n)
    ]
    text = " ".join(fillers)
    sites = _sites(n, text, rng)
    values = {
        kind.name: rng.sample(kind.values, n) if kind.values else _codes(n, text, rng) for kind in KINDS
    }
    docs = []
    for i, filler in enumerate(fillers):
        sentences = corpora.sentences(filler)
        facts = [kind.sentence(sites[i], values[kind.name][i]) for kind in KINDS]
        rng.shuffle(facts)
        for fact in facts:
            # Anywhere after the opening sentence, which says what the passage is about.
            sentences.insert(rng.randint(1, len(sentences)), fact)
        docs.append(Doc(f"d{k}-{i}", " ".join(sentences) + "\n\n"))
    return _Pool(docs, sites, values)


def _sites(n: int, filler: str, rng: random.Random) -> list[str]:
    """n distinct invented site names ("Harlow depot") whose name word is found nowhere else: not in
    the filler, not among the values."""
    taken = {v.lower() for kind in KINDS for v in kind.values}
    names: list[str] = []
    while len(names) < n:
        name = (
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) + rng.choice(_ENDINGS)
        ).capitalize()
        if name.lower() in taken or _has_word(filler, name):
            continue
        taken.add(name.lower())
        names.append(f"{name} {rng.choice(_SITE_TYPES)}")
    return names


def _codes(n: int, filler: str, rng: random.Random) -> list[str]:
    codes: list[str] = []
    while len(codes) < n:
        code = str(rng.randint(1000, 9999))
        if code not in codes and not _has_word(filler, code):
            codes.append(code)
    return codes


def _has_word(text: str, word: str) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", text, re.IGNORECASE) is not None
