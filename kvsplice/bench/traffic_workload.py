"""What `kvsplice bench traffic` sends: RAG chat messages, each carrying k passages drawn with Zipf
popularity from a pool and a question, on an open-loop Poisson schedule. Pure: no server, no model."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvsplice.bench import corpus as corpora

SYSTEM_MESSAGE = "Answer the question using the passages the user gives."


@dataclass(frozen=True)
class Mix:
    """How often passages recur: each request draws its passages from `pool` passages, the one of
    popularity rank r (1-based) with weight 1 / r**zipf, no passage twice in one request."""

    name: str
    pool: int
    zipf: float
    description: str


MIXES = {
    # 10 passages for 4 slots a request: once the pool is seen, every slot repeats one.
    "popular": Mix("popular", 10, 1.0, "a small pool, strong Zipf: most passage slots repeat an earlier one"),
    # 600 passages, flat-ish: about 93 % of the slots of 12 requests are first seen, a few recur.
    "novel": Mix("novel", 600, 0.5, "a large pool, weak Zipf: most passages are seen once"),
}


@dataclass(frozen=True)
class TrafficRequest:
    # Indices into the mix's pool, in prompt order: what first_seen_share counts.
    passage_ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...]


def parse_mixes(names: list[str]) -> tuple[Mix, ...]:
    unknown = [n for n in names if n not in MIXES]
    if unknown:
        raise ValueError(f"unknown mix {', '.join(unknown)}; choose from {', '.join(MIXES)}")
    return tuple(MIXES[n] for n in dict.fromkeys(names))


def zipf_draw(rng: random.Random, weights: list[float], k: int) -> list[int]:
    """k distinct indices drawn by weight without replacement (Efraimidis-Spirakis: the k largest keys
    u**(1/w)), in the order drawn, which is the order they appear in the prompt."""
    if not 0 < k <= len(weights):
        raise ValueError(f"cannot draw {k} distinct passages from a pool of {len(weights)}")
    keys = [rng.random() ** (1.0 / w) for w in weights]
    return sorted(range(len(weights)), key=keys.__getitem__, reverse=True)[:k]


def zipf_weights(pool: int, exponent: float) -> list[float]:
    return [1.0 / (rank + 1) ** exponent for rank in range(pool)]


def build_requests(
    mix: Mix, n: int, k: int, doc_words: int, seed: int, source: corpora.Corpus, marked: bool = False
) -> list[TrafficRequest]:
    """n requests of k passages (each cut to doc_words words) from the first min(mix.pool, corpus)
    passages of a seeded shuffle; questions from the corpus's items, or generic ones. `marked`: each
    passage a content part marked as a segment (`kvsplice_segment`), as a client that marks them sends;
    else one plain string, as most clients send."""
    rng = random.Random(f"{mix.name}-{seed}")
    passages = rng.sample(source.passages, min(mix.pool, len(source.passages)))
    texts = [f"{p.title}\n{corpora.trim(p.text, doc_words)}" for p in passages]
    questions = [item.question for item in source.items] or [
        f"What is known about {p.title}?" for p in passages
    ]
    weights = zipf_weights(len(passages), mix.zipf)
    requests = []
    for _ in range(n):
        ids = zipf_draw(rng, weights, k)
        question = f"\n\nQuestion: {questions[rng.randrange(len(questions))]}"
        user: str | list[dict[str, Any]]
        if marked:
            # The server joins a message's parts with "\n": the prompt is the plain one's text.
            user = [
                {"type": "text", "text": "Passages:\n"},
                *({"type": "text", "text": texts[i] + "\n", "kvsplice_segment": True} for i in ids),
                {"type": "text", "text": question.lstrip()},
            ]
        else:
            user = "Passages:\n\n" + "\n\n".join(texts[i] for i in ids) + question
        messages = ({"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": user})
        requests.append(TrafficRequest(tuple(ids), messages))
    return requests


def first_seen_share(requests: list[TrafficRequest]) -> float:
    """The share of passage slots whose passage no earlier request carried (a cache's cold slots)."""
    seen: set[int] = set()
    new = slots = 0
    for request in requests:
        for passage in request.passage_ids:
            new += passage not in seen
            seen.add(passage)
        slots += len(request.passage_ids)
    return new / slots if slots else 0.0


def poisson_schedule(rate: float, n: int, rng: random.Random) -> list[float]:
    """Send times (s from the cell's start) of n requests arriving as a Poisson process of `rate`
    per second: the first at 0, then exponential gaps of mean 1/rate."""
    if rate <= 0:
        raise ValueError(f"a rate must be > 0 requests/s, got {rate}")
    times = [0.0]
    for _ in range(n - 1):
        times.append(times[-1] + rng.expovariate(rate))
    return times[:n]
