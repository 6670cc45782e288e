"""Benchmark workloads, seeded and deterministic: rag, qa and fewshot here, chat and agent in
conversations.py, recall in recall.py. Each is a list of requests made of prompt parts.

A request's prompt is a tuple of parts: plain strings (instructions, questions, turns) and `Doc`s,
the reusable content (documents, examples, tool outputs). A system decides how to pass a Doc: as a
`Segment` (splicing systems) or as a plain string (no cache, prefix caches). Parts are tokenised one
by one, so the tokens are the same either way.

Requests marked `warmup` introduce the shared content and are not measured; every measured request
of rag, qa and fewshot carries only documents that earlier requests carried, in an order no earlier
request had. chat and agent build each turn by extending the previous turn's prompt.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from kvsplice.bench import corpus as corpora
from kvsplice.bench.base import (
    BenchRequest,
    Doc,
    Part,
    Workload,
    WorkloadSpec,
    draw_pool,
    new_orders,
    warmup_orders,
)
from kvsplice.bench.conversations import agent, chat
from kvsplice.bench.recall import recall
from kvsplice.bench.synth import KINDS

DEFAULTS = {
    "rag": WorkloadSpec(requests=6, docs=6, pool=8, doc_words=280),
    "qa": WorkloadSpec(requests=8, docs=6, pool=8, doc_words=280),
    "chat": WorkloadSpec(requests=3, turns=5, pool=4, doc_words=150),
    "agent": WorkloadSpec(requests=3, turns=4, pool=6, doc_words=180),
    "fewshot": WorkloadSpec(requests=8, docs=8, pool=8, doc_words=60),
    # requests: per setting; doc_words: the filler's most words (with the facts, ~500 tokens).
    "recall": WorkloadSpec(requests=24, doc_counts=(4, 8, 12), pool=24, doc_words=290),
}

RAG_INSTRUCTION = "Answer the question using the documents below.\n\n"
QA_INSTRUCTION = "Read the documents below and answer the question.\n\n"
FEWSHOT_INSTRUCTION = "Classify each text as a place, a person or an organisation.\n\n"


def make_workload(name: str, spec: WorkloadSpec | None = None) -> Workload:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    spec = resolve(name, spec or WorkloadSpec())
    return WORKLOADS[name](spec)


def resolve(name: str, spec: WorkloadSpec) -> WorkloadSpec:
    defaults = DEFAULTS[name]
    if defaults.doc_counts is None and spec.doc_counts is not None:
        raise ValueError(f"{name} takes one count of documents per request (docs), not several")
    if defaults.doc_counts is not None and spec.docs is not None:
        if spec.doc_counts is not None:
            raise ValueError("give the documents per request as docs or as doc_counts, not both")
        spec = dataclasses.replace(spec, docs=None, doc_counts=(spec.docs,))
    sizes = {
        f.name: getattr(defaults, f.name) if getattr(spec, f.name) is None else getattr(spec, f.name)
        for f in dataclasses.fields(spec)
    }
    resolved = WorkloadSpec(**sizes)
    for field in ("requests", "docs", "pool", "turns", "doc_words"):
        value = getattr(resolved, field)
        if value is not None and value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if resolved.doc_counts is not None and not resolved.doc_counts:
        raise ValueError("doc_counts needs at least one count")
    if resolved.docs is not None and resolved.pool is not None and resolved.pool < resolved.docs:
        raise ValueError(f"the pool ({resolved.pool}) must hold at least docs ({resolved.docs}) documents")
    return resolved


# -- rag ------------------------------------------------------------------------------------------


def rag(spec: WorkloadSpec) -> Workload:
    assert spec.docs and spec.pool and spec.requests and spec.doc_words
    rng = random.Random(spec.seed)
    source = corpora.load(spec.source)
    if source.items:
        # The pool gathers the passages retrieved for a few questions (about 5 each); requests ask those.
        items = rng.sample(source.items, -(-spec.pool // 5))
        per_item = -(-spec.pool // len(items))
        chosen = [p for item in items for p in item.passages[:per_item]][: spec.pool]
        if len(chosen) < spec.pool:
            # A question retrieved fewer passages than its share: other questions top the pool up (drawn
            # only then, so that every other seed keeps the pool it had).
            rest = [item for item in source.items if item not in items]
            for item in rng.sample(rest, len(rest)):
                if len(chosen) == spec.pool:
                    break
                items.append(item)
                chosen += item.passages[: spec.pool - len(chosen)]
        if len(chosen) < spec.pool:
            raise ValueError(f"the {source.name} corpus has {len(chosen)} passages for a pool of {spec.pool}")
        texts = [corpora.trim(p.text, spec.doc_words) for p in chosen]
        questions = [(item.question, item.answers) for item in items]
    else:
        texts = draw_pool(source.passages, spec.pool, spec.doc_words, rng)
        questions = [(f"What is known about {p.title}?", ()) for p in rng.sample(source.passages, 4)]
    docs = [Doc(f"doc{i}", text + "\n\n") for i, text in enumerate(texts)]
    warm = warmup_orders(spec.pool, spec.docs, rng)
    measured = new_orders(spec.pool, spec.docs, spec.requests, {tuple(d) for d in warm}, rng)
    requests = []
    for i, draw in enumerate(warm + measured):
        question, answers = questions[rng.randrange(len(questions))]
        parts: tuple[Part, ...] = (
            RAG_INSTRUCTION,
            *(docs[j] for j in draw),
            f"Question: {question}\nAnswer:",
        )
        requests.append(BenchRequest(f"rag-{i}", parts, warmup=i < len(warm), answers=answers))
    return Workload(
        "rag",
        spec,
        tuple(requests),
        source.name,
        f"{spec.docs} of {spec.pool} shared passages per request, in a new order each time, then the "
        "question",
    )


# -- qa -------------------------------------------------------------------------------------------

_COLOURS = ["Blue", "Red", "Green", "Copper", "Silver", "Amber", "Black", "White", "Golden", "Violet", "Grey"]
_OBJECTS = ["vault", "gate", "locker", "safe", "cellar", "tower", "archive", "chest"]


def qa(spec: WorkloadSpec) -> Workload:
    """Each pool document is a synthetic passage with one planted fact ("The access code of the Blue
    vault is 4817."); a request asks for the code of one of its documents' entities."""
    assert spec.docs and spec.pool and spec.requests and spec.doc_words
    rng = random.Random(spec.seed)
    passages = corpora.load("synthetic").passages
    fillers = draw_pool(passages, spec.pool, spec.doc_words, rng)
    entities = rng.sample([f"{c} {o}" for c in _COLOURS for o in _OBJECTS], spec.pool)
    everything = " ".join(fillers)
    codes: list[str] = []
    while len(codes) < spec.pool:
        code = str(rng.randint(1000, 9999))
        if code not in everything and code not in codes:
            codes.append(code)
    docs = []
    for i, (filler, entity, code) in enumerate(zip(fillers, entities, codes, strict=True)):
        sentences = corpora.sentences(filler)
        # Anywhere after the opening sentence.
        sentences.insert(rng.randint(1, len(sentences)), f"The access code of the {entity} is {code}.")
        docs.append(Doc(f"doc{i}", " ".join(sentences) + "\n\n"))
    warm = warmup_orders(spec.pool, spec.docs, rng)
    measured = new_orders(spec.pool, spec.docs, spec.requests, {tuple(d) for d in warm}, rng)
    requests = []
    for i, draw in enumerate(warm + measured):
        gold = rng.choice(draw)
        entity = entities[gold]
        question = (
            f"Question: What is the access code of the {entity}?\nAnswer: The access code of the {entity} is"
        )
        parts: tuple[Part, ...] = (QA_INSTRUCTION, *(docs[j] for j in draw), question)
        requests.append(
            BenchRequest(f"qa-{i}", parts, i < len(warm), answers=(codes[gold],), answer_doc=docs[gold].key)
        )
    return Workload(
        "qa",
        spec,
        tuple(requests),
        "synthetic",
        f"{spec.docs} of {spec.pool} shared synthetic passages per request, each with one planted access "
        "code; the question asks for the code in one of them",
    )


# -- fewshot --------------------------------------------------------------------------------------


def fewshot(spec: WorkloadSpec) -> Workload:
    """Topic classification (place / person / organisation) with the same labelled examples in a
    new order per request; the query text is new each time."""
    assert spec.docs and spec.pool and spec.requests and spec.doc_words
    rng = random.Random(spec.seed)
    passages = list(corpora.load("synthetic").passages)
    by_kind = {kind: [p for p in passages if p.kind == kind] for kind in KINDS}
    for group in by_kind.values():
        rng.shuffle(group)
    # Examples cycle through the kinds, so every label is demonstrated.
    examples = [by_kind[KINDS[i % len(KINDS)]].pop() for i in range(spec.pool)]
    docs = [
        Doc(f"ex{i}", f"Text: {corpora.trim(p.text, spec.doc_words)}\nCategory: {p.kind}\n\n")
        for i, p in enumerate(examples)
    ]
    queries = [p for group in by_kind.values() for p in group]
    rng.shuffle(queries)
    warm = warmup_orders(spec.pool, spec.docs, rng)
    measured = new_orders(spec.pool, spec.docs, spec.requests, {tuple(d) for d in warm}, rng)
    draws = warm + measured
    if len(draws) > len(queries):
        raise ValueError(f"fewshot has {len(queries)} query texts for {len(draws)} requests")
    requests = []
    for i, draw in enumerate(draws):
        query = queries[i]
        parts: tuple[Part, ...] = (
            FEWSHOT_INSTRUCTION,
            *(docs[j] for j in draw),
            f"Text: {corpora.trim(query.text, spec.doc_words)}\nCategory:",
        )
        requests.append(BenchRequest(f"fewshot-{i}", parts, i < len(warm), answers=(query.kind,)))
    return Workload(
        "fewshot",
        spec,
        tuple(requests),
        "synthetic",
        f"{spec.docs} labelled examples (of {spec.pool}) in a new order per request, then a new text to "
        "classify",
    )


WORKLOADS: dict[str, Callable[[WorkloadSpec], Workload]] = {
    "rag": rag,
    "qa": qa,
    "chat": chat,
    "agent": agent,
    "fewshot": fewshot,
    "recall": recall,
}
