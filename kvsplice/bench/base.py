"""The shapes every workload shares: reusable documents, requests made of prompt parts, sizes, and
the seeded draws that give each request its documents in a new order."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.bench import corpus as corpora


@dataclass(frozen=True)
class Doc:
    """Reusable content; `key` names it within the workload."""

    key: str
    text: str


Part = str | Doc


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    parts: tuple[Part, ...]
    warmup: bool = False
    # Checkable answers (accuracy: one of them appears in the first line of the greedy continuation).
    answers: tuple[str, ...] = ()
    # The key of the one document that holds the answer.
    answer_doc: str | None = None
    # Conversation or episode, and the turn (or step) within it.
    group: str = ""
    turn: int = 0
    # The setting the request belongs to ("8 docs") and where its answer document sits ("first",
    # "middle", "last"): the report breaks accuracy and fidelity down by both.
    setting: str = ""
    answer_position: str = ""
    # Judge the answer at the start of the continuation (the prompt ends where the answer begins)
    # instead of anywhere in its first line.
    answer_at_start: bool = False

    @property
    def docs(self) -> tuple[Doc, ...]:
        return tuple(p for p in self.parts if isinstance(p, Doc))

    @property
    def text(self) -> str:
        return "".join(p.text if isinstance(p, Doc) else p for p in self.parts)


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes; None takes the workload's default (see DEFAULTS)."""

    # Measured requests (chat: conversations; agent: measured episodes).
    requests: int | None = None
    seed: int = 0
    # Documents per request (rag, qa); examples per prompt (fewshot).
    docs: int | None = None
    # Several settings of documents per request, each measured on its own (recall); a workload with
    # settings takes one `docs` as the one setting.
    doc_counts: tuple[int, ...] | None = None
    # Distinct documents the requests draw from (examples for fewshot, tool outputs for agent).
    pool: int | None = None
    # Turns per conversation (chat); steps per episode (agent).
    turns: int | None = None
    # Documents are cut at a sentence end to at most this many words.
    doc_words: int | None = None
    # Text source for rag, chat and agent: "auto" (MuSiQue when present), "musique", "synthetic".
    source: str = "auto"


@dataclass(frozen=True)
class Workload:
    name: str
    spec: WorkloadSpec  # with every size resolved
    requests: tuple[BenchRequest, ...]
    corpus: str
    description: str

    @property
    def measured(self) -> tuple[BenchRequest, ...]:
        return tuple(r for r in self.requests if not r.warmup)

    @property
    def has_turns(self) -> bool:
        return any(r.turn for r in self.requests)


def warmup_orders(pool: int, k: int, rng: random.Random) -> list[list[int]]:
    """Draws of k pool indices that together carry every pool document (the last one topped up)."""
    order = list(range(pool))
    rng.shuffle(order)
    draws = [order[i : i + k] for i in range(0, pool, k)]
    last = draws[-1]
    if len(last) < k:
        last += rng.sample([i for i in range(pool) if i not in last], k - len(last))
    return draws


def new_orders(pool: int, k: int, n: int, seen: set[tuple[int, ...]], rng: random.Random) -> list[list[int]]:
    """n draws of k pool indices, each in an order that no earlier draw (nor `seen`) had."""
    draws = []
    for _ in range(n):
        for _attempt in range(1000):
            draw = rng.sample(range(pool), k)
            if tuple(draw) not in seen:
                break
        else:
            raise ValueError(f"cannot draw {n} distinct orders of {k} of {pool} documents")
        seen.add(tuple(draw))
        draws.append(draw)
    return draws


def draw_pool(passages: Sequence[corpora.Passage], n: int, words: int, rng: random.Random) -> list[str]:
    if n > len(passages):
        raise ValueError(f"the corpus has {len(passages)} passages, the pool needs {n}")
    return [corpora.trim(passages[i].text, words) for i in rng.sample(range(len(passages)), n)]
