"""The recall workload: deterministic, balanced answer positions, same-kind distractors that never
equal the answer, the answer exactly once in the prompt, documents warmed before they are asked in a
new order, and (with Gemma 3's tokenizer) documents of 100 to 500 tokens whose answers are the first
generated token. No model runs."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from kvsplice.bench import corpus as corpora
from kvsplice.bench.base import BenchRequest, WorkloadSpec
from kvsplice.bench.recall import KINDS, POSITIONS, FactKind
from kvsplice.bench.workloads import make_workload
from kvsplice.loader.tokenizer import Tokenizer


def _question(request: BenchRequest) -> tuple[FactKind, str, str]:
    """The asked kind, the site and the prompt's answer line."""
    question = request.parts[-1]
    assert isinstance(question, str)
    asked, answer_line = question.removeprefix("Question: ").split("\nAnswer: ")
    for kind in KINDS:
        pattern = re.escape(kind.question).replace(re.escape("{site}"), "(.+)")
        match = re.fullmatch(pattern, asked)
        if match:
            return kind, match.group(1), answer_line
    raise AssertionError(f"no kind asks {asked!r}")


def _count(text: str, word: str) -> int:
    return len(re.findall(rf"\b{re.escape(word)}\b", text, re.IGNORECASE))


@pytest.fixture(scope="module")
def workload():
    return make_workload("recall", WorkloadSpec(seed=7, requests=30))


def test_deterministic_and_settings_independent() -> None:
    spec = WorkloadSpec(seed=2, requests=6)
    assert make_workload("recall", spec) == make_workload("recall", spec)
    assert (
        make_workload("recall", WorkloadSpec(seed=3, requests=6)).requests
        != make_workload("recall", spec).requests
    )
    # A setting's requests do not depend on which other settings run with it.
    alone = make_workload("recall", WorkloadSpec(seed=2, requests=6, docs=8))
    assert alone.spec.doc_counts == (8,) and alone.spec.docs is None
    together = make_workload("recall", spec)
    assert alone.requests == tuple(r for r in together.requests if r.setting == "8 docs")
    assert make_workload("recall", WorkloadSpec(requests=2, doc_counts=(12, 4))).spec.doc_counts == (12, 4)


def test_default_settings_and_sizes() -> None:
    workload = make_workload("recall")
    assert workload.spec.doc_counts == (4, 8, 12) and workload.spec.requests == 24
    counts = Counter(r.setting for r in workload.measured)
    assert counts == {"4 docs": 24, "8 docs": 24, "12 docs": 24}
    # Settings take turns among the measured requests; warm-ups come first.
    assert [r.setting for r in workload.measured[:3]] == ["4 docs", "8 docs", "12 docs"]
    first_measured = workload.requests.index(workload.measured[0])
    assert all(r.warmup for r in workload.requests[:first_measured])
    assert all(len(r.docs) == int(r.setting.split()[0]) for r in workload.requests)


def test_two_hundred_cases_per_setting_with_balanced_positions_and_kinds() -> None:
    workload = make_workload("recall", WorkloadSpec(seed=1, requests=200))
    for setting in ("4 docs", "8 docs", "12 docs"):
        measured = [r for r in workload.measured if r.setting == setting]
        assert len(measured) == 200
        positions = Counter(r.answer_position for r in measured)
        kinds = Counter(_question(r)[0].name for r in measured)
        assert set(positions) == set(POSITIONS) and max(positions.values()) - min(positions.values()) <= 1
        assert set(kinds) == {k.name for k in KINDS} and max(kinds.values()) - min(kinds.values()) <= 1
    # Balanced in every prefix too, so a short run is as stratified as a long one.
    first = [r.answer_position for r in workload.measured if r.setting == "8 docs"][:7]
    assert max(Counter(first).values()) - min(Counter(first).values()) <= 1


def test_answer_document_sits_at_its_stated_position(workload) -> None:
    for request in workload.measured:
        keys = [d.key for d in request.docs]
        index = keys.index(request.answer_doc)
        k = len(keys)
        expected = {"first": [0], "last": [k - 1], "middle": sorted({(k - 1) // 2, k // 2})}
        assert index in expected[request.answer_position], (request.request_id, index)
        assert request.answer_at_start and request.setting == f"{k} docs"


def test_distractors_are_same_kind_and_never_the_answer(workload) -> None:
    for request in workload.measured:
        kind, site, _ = _question(request)
        (answer,) = request.answers
        lead = re.escape(kind.lead).replace(re.escape("{site}"), r"(\w+ \w+)")
        found = {}
        for doc in request.docs:
            facts = re.findall(lead + r" (\w+)\.", doc.text)
            assert len(facts) == 1, (request.request_id, doc.key, facts)
            found[doc.key] = facts[0]
        (gold_site, gold_value) = found.pop(request.answer_doc)
        assert (gold_site, gold_value) == (site, answer)
        # Every other document states the same kind of fact, about another site, with another value
        # whose first token differs too, so the first generated token already tells them apart.
        assert len(found) == len(request.docs) - 1
        for other_site, value in found.values():
            assert other_site != site and value != answer
            assert kind.first_token(value) != kind.first_token(answer)


def test_answer_appears_once_in_its_document_and_nowhere_else(workload) -> None:
    for request in workload.requests:
        (answer,) = request.answers
        gold = next(d for d in request.docs if d.key == request.answer_doc)
        assert _count(gold.text, answer) == 1
        assert sum(_count(d.text, answer) for d in request.docs) == 1
        assert not any(_count(p, answer) for p in request.parts if isinstance(p, str))
        # The prompt's answer line is the fact sentence up to the answer.
        kind, site, answer_line = _question(request)
        assert answer_line == kind.prompt(site)
        assert f"{answer_line.rstrip(' ')} {answer}." in gold.text


def test_documents_are_warmed_then_asked_in_a_new_order(workload) -> None:
    for setting in ("4 docs", "8 docs", "12 docs"):
        requests = [r for r in workload.requests if r.setting == setting]
        seen_docs: set[str] = set()
        orders: set[tuple[str, ...]] = set()
        for request in requests:
            keys = tuple(d.key for d in request.docs)
            if not request.warmup:
                assert set(keys) <= seen_docs and keys not in orders
            seen_docs |= set(keys)
            orders.add(keys)
        assert len(seen_docs) == workload.spec.pool
        # The same key always carries the same text.
        texts: dict[str, str] = {}
        for request in requests:
            for doc in request.docs:
                assert texts.setdefault(doc.key, doc.text) == doc.text


def test_value_lists_are_distinct_and_absent_from_the_corpus() -> None:
    corpus = " ".join(p.text for p in corpora.load("synthetic").passages)
    values = [v.lower() for kind in KINDS for v in kind.values]
    assert len(values) == len(set(values))
    assert not [v for v in values if _count(corpus, v)]
    emblem = next(k for k in KINDS if k.name == "emblem")
    assert not [v for v in emblem.values if v[0] in "aeiou"]


def test_invalid_recall_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="3 to pool"):
        make_workload("recall", WorkloadSpec(docs=2))
    with pytest.raises(ValueError, match="at most"):
        make_workload("recall", WorkloadSpec(pool=100))
    with pytest.raises(ValueError, match="not several"):
        make_workload("qa", WorkloadSpec(doc_counts=(4, 8)))
    with pytest.raises(ValueError, match="not both"):
        make_workload("recall", WorkloadSpec(docs=4, doc_counts=(4, 8)))


def test_gemma_tokens_documents_and_first_answer_token(workload, default_model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(default_model_dir)
    for kind in KINDS:
        assert all(len(tokenizer.encode(" " + v)) == 1 for v in kind.values), kind.name
    lengths = [
        len(tokenizer.encode(d.text)) for d in {d.key: d for r in workload.requests for d in r.docs}.values()
    ]
    assert min(lengths) >= 100 and max(lengths) <= 500 and max(lengths) - min(lengths) > 250
    for request in workload.measured:
        kind, site, answer_line = _question(request)
        (answer,) = request.answers
        prompt = tokenizer.encode(answer_line)
        full = tokenizer.encode(kind.sentence(site, answer))
        # The answer line tokenises as the start of the fact sentence, and the next token of the
        # sentence begins the answer: the first generated token is the answer's content.
        assert full[: len(prompt)] == prompt
        first = tokenizer.decode([full[len(prompt)]]).lstrip(" ")
        assert first and answer.startswith(first)
        if not kind.digits:
            assert first == answer
