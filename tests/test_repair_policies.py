"""The plan and the repair policies are plain data and functions: tested without a model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvsplice.plan import SpanKind, make_plan
from kvsplice.repair.base import RepairTask
from kvsplice.repair.policies import DeviationObserver
from kvsplice.repair.registry import budget_tokens, make_policy
from tests import tiny_models


@st.composite
def prompts(draw):
    n = draw(st.integers(2, 60))
    cuts = sorted(draw(st.sets(st.integers(0, n), max_size=10)))
    segments = []
    for i in range(0, len(cuts) - 1, 2):
        if cuts[i] < cuts[i + 1]:
            segments.append((cuts[i], cuts[i + 1], len(segments)))
    prefix = draw(st.integers(0, n - 1))
    return n, prefix, segments


@given(prompts(), st.data())
def test_plan_classifies_every_position_like_the_oracle(case, data) -> None:
    n, prefix, segments = case
    indices = [index for *_, index in segments]
    discovered = data.draw(st.frozensets(st.sampled_from(indices))) if indices else frozenset()
    head = data.draw(st.integers(0, 4))
    plan = make_plan(n, prefix, segments, discovered, head=head)

    def oracle(p: int) -> SpanKind:
        if p < prefix:
            return SpanKind.EXACT
        if p == n - 1:
            return SpanKind.COMPUTE
        for start, end, index in segments:
            # A found segment's first `head` tokens after whatever precedes it are computed.
            if start <= p < end and p >= max(start, prefix) + (head if index in discovered else 0):
                return SpanKind.SPLICED
        return SpanKind.COMPUTE

    kinds = {p: s.kind for s in plan.spans for p in range(s.start, s.end)}
    assert [kinds[p] for p in range(n)] == [oracle(p) for p in range(n)]
    assert sum(plan.tokens(k) for k in SpanKind) == n
    in_found = [any(s <= p < e and i in discovered for s, e, i in segments) for p in range(n)]
    assert plan.heads == sum(in_found[p] and kinds[p] is SpanKind.COMPUTE for p in range(prefix, n - 1))
    for span in plan.spliced():
        start, end, index = segments[span.segment]
        assert start + span.segment_offset == span.start and span.end <= end and index == span.segment
        assert span.discovered == (index in discovered)


def test_plan_prints_its_spans() -> None:
    plan = make_plan(20, 4, [(2, 8, 0), (10, 20, 1)])
    assert str(plan) == "exact[0:4) spliced[4:8) compute[8:10) spliced[10:19) compute[19:20)"


@given(prompts(), st.floats(0, 1), st.sampled_from(["none", "boundary", "deviation", "full"]))
def test_policies_choose_spliced_positions_within_budget(case, ratio, name) -> None:
    n, prefix, segments = case
    plan = make_plan(n, prefix, segments)
    spliced = plan.positions(SpanKind.SPLICED)
    budget = budget_tokens(len(spliced), ratio)
    policy = make_policy(name)
    task = RepairTask(plan, budget, num_layers=4)
    decision = policy.decide(task)
    assert set(decision.recompute) <= set(spliced)
    assert list(decision.recompute) == sorted(set(decision.recompute))
    if name == "full":
        assert list(decision.recompute) == spliced
    elif decision.probe is not None:
        assert set(decision.probe.positions) == set(spliced) and decision.probe.last_layer == 1
        assert isinstance(decision.probe.observer, DeviationObserver)
        decision.probe.observer.score = torch.rand(n)
        chosen = policy.choose(task, decision.probe, None)
        assert len(chosen) == budget and list(chosen) == sorted(set(chosen)) and set(chosen) <= set(spliced)
    else:
        assert len(decision.recompute) <= budget


def test_boundary_takes_the_first_tokens_of_each_segment() -> None:
    plan = make_plan(30, 0, [(1, 11, 0), (11, 21, 1)])
    decision = make_policy("boundary").decide(RepairTask(plan, 5, num_layers=4))
    assert decision.recompute == (1, 2, 3, 11, 12)


def test_deviation_keeps_the_most_deviating_tokens() -> None:
    policy = make_policy("deviation")
    task = RepairTask(make_plan(8, 0, [(1, 5, 0)]), 2, num_layers=4)
    probe = policy.decide(task).probe
    assert probe is not None and probe.positions == (1, 2, 3, 4)
    assert isinstance(probe.observer, DeviationObserver)
    probe.observer.score = torch.tensor([9.0, 0.1, 5.0, 0.2, 3.0, 9.0, 9.0, 9.0])  # only 1..4 are candidates
    assert policy.choose(task, probe, None) == (2, 4)


@pytest.mark.parametrize("spliced, ratio, expected", [(100, 0.15, 15), (5, 0.5, 2), (5, 1.0, 5), (7, 0.0, 0)])
def test_budget(spliced: int, ratio: float, expected: int) -> None:
    assert budget_tokens(spliced, ratio) == expected


def test_lead_probes_the_question_and_recomputes_what_it_attends_to() -> None:
    from kvsplice.repair.attention import QueryAttentionObserver, probe_layers

    cfg = tiny_models.llama_config()
    plan = make_plan(12, 2, [(2, 5, 0), (6, 9, 1)])
    task = RepairTask(plan, 2, num_layers=4, model=cfg)
    policy = make_policy("attention")
    probe = policy.decide(task).probe
    assert probe is not None and probe.positions == () and not probe.resume
    # Every layer is global: the first at or past a quarter of the depth (of 4 layers, layer 1).
    assert probe.last_layer == 1 and probe_layers(cfg) == {1}
    assert isinstance(probe.observer, QueryAttentionObserver)
    # The question is what follows the last reused token.
    assert probe.observer._watched.nonzero().squeeze(1).tolist() == [9, 10, 11]
    probe.observer.score = torch.tensor([9.0, 9, 0.1, 3, 0.2, 9, 0.3, 0.4, 5, 9, 9, 9])
    assert policy.choose(task, probe, None) == (3, 8)


def test_after_a_question_probe_only_the_question_runs_the_probe_layers_again() -> None:
    """The chosen tokens and the question (the computed tokens after the last reused one) run from the
    first layer; every other computed token resumes from the probe, so it runs each layer once."""
    from collections import Counter

    from kvsplice.reuse.repair_run import RepairRun

    # Positions 0-1 cached, 2-4 and 6-8 spliced, 5 (a new document, a separator) and 9-11 (the
    # question) computed.
    plan = make_plan(12, 2, [(2, 5, 0), (6, 9, 1)])

    def passes(score: list[float]) -> list[tuple[tuple[int, ...], range]]:
        run = RepairRun(
            make_policy("attention"), RepairTask(plan, 2, num_layers=4, model=tiny_models.llama_config())
        )
        run.first.observer.score = torch.tensor(score)  # type: ignore[union-attr]
        found = [run.first]
        while (following := run.next_pass(None)) is not None:
            found.append(following)
        return [(p.positions, p.layers) for p in found]

    for score, chosen in [
        # The first segment's best (at most half the budget), then the best anywhere.
        ([9.0, 9, 0.1, 0.2, 0.3, 9, 0.4, 5, 6, 9, 9, 9], (4, 8)),
        ([9.0, 9, 0.1, 3, 0.2, 9, 0.3, 0.4, 5, 9, 9, 9], (3, 8)),
    ]:
        runs = passes(score)
        assert runs == [
            ((5, 9, 10, 11), range(2)),
            ((*chosen, 9, 10, 11), range(2)),
            ((*sorted({5, *chosen}), 9, 10, 11), range(2, 4)),
        ]
        layers = Counter(pos for positions, span in runs for pos in positions for _ in span)
        assert layers == {5: 4, chosen[0]: 4, chosen[1]: 4, 9: 6, 10: 6, 11: 6}


def test_a_new_document_after_the_last_reused_one_is_not_the_question() -> None:
    from collections import Counter

    from kvsplice.reuse.repair_run import RepairRun

    # Positions 0-1 cached, 2-4 spliced, 5-8 a marked document new to the store (computed), 9-11 the
    # question.
    plan = make_plan(12, 2, [(2, 5, 0)], question_from=9)
    assert plan.question() == (9, 10, 11)
    # Without markup there is no telling a document from the question: all that follows the last reuse.
    assert make_plan(12, 2, [(2, 5, 0)]).question() == tuple(range(5, 12))
    # A prompt that ends with its last marked segment: the question is at least the last token.
    assert make_plan(12, 2, [(2, 5, 0)], question_from=12).question() == (11,)
    run = RepairRun(
        make_policy("attention"), RepairTask(plan, 1, num_layers=4, model=tiny_models.llama_config())
    )
    assert run.first.observer._watched.nonzero().squeeze(1).tolist() == [9, 10, 11]  # type: ignore[union-attr]
    run.first.observer.score = torch.tensor([9.0, 9, 0.1, 3, 0.2, 9, 9, 9, 9, 9, 9, 9])  # type: ignore[union-attr]
    runs = [(run.first.positions, run.first.layers)]
    while (following := run.next_pass(None)) is not None:
        runs.append((following.positions, following.layers))
    # The new document runs each layer once, resuming from the probe like any computed token before it.
    layers = Counter(pos for positions, span in runs for pos in positions for _ in span)
    assert layers == {5: 4, 6: 4, 7: 4, 8: 4, 3: 4, 9: 6, 10: 6, 11: 6}


def test_adaptive_doubles_its_repair_until_the_answer_stops_moving_then_falls_back() -> None:
    from kvsplice.repair.adaptive import TARGET, AdaptiveRepair
    from kvsplice.repair.attention import QueryAttentionObserver
    from kvsplice.sampling import kl_divergence

    cfg = tiny_models.llama_config()
    # 100 spliced tokens (positions 1..100) and a question (101..103); ranked by position, descending.
    plan = make_plan(104, 1, [(1, 101, 0)])

    # Concentrated: the top 15% of the reused tokens hold 77% of the question's attention on them.
    concentrated = torch.arange(104.0) ** 8

    def run(estimates: list[torch.Tensor], score: torch.Tensor = concentrated) -> list[tuple[int, ...]]:
        task = RepairTask(plan, 100, num_layers=4, model=cfg)
        policy = AdaptiveRepair()
        probe = policy.decide(task).probe
        assert probe is not None and probe.last_layer == 3 and not probe.resume
        assert isinstance(probe.observer, QueryAttentionObserver)
        probe.observer.score = score
        rounds = [policy.choose(task, probe, estimates[0])]
        for logits in estimates[1:]:
            more = policy.refine(task, logits)
            if more is None:
                break
            rounds.append(more)
        return rounds

    a, b, c = torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0]), torch.tensor([0.0, 2.0, 0.1])
    assert kl_divergence(a, a) == pytest.approx(0.0, abs=1e-7) and kl_divergence(a, b) > 1.0
    assert 0 < kl_divergence(c, b) < TARGET
    # Converges: round 1 moved the answer (a -> b), round 2 barely (b -> c): stop after round 2.
    rounds = run([a, b, c, a, b])
    assert rounds == [tuple(range(86, 101)), tuple(range(71, 101))]
    # Never converges: 15, then 30 tokens; 60 would pass half the reused tokens, so then everything
    # at once (a full prefill).
    rounds = run([a, b, a, b, a, b, a, b])
    assert [len(r) for r in rounds] == [15, 30, 100]
    assert rounds[-1] == tuple(range(1, 101))
    # Attention spread evenly (few-shot): no sparse repair is trusted, the first round takes every
    # reused token, whatever the estimates would have said.
    assert run([a, a, a], score=torch.ones(104)) == [tuple(range(1, 101))]
    # Just below the trusted coverage, and just above it.
    from kvsplice.repair.adaptive import TRUSTED_COVERAGE, coverage

    assert coverage(concentrated[1:101], 0.15) > TRUSTED_COVERAGE > coverage(torch.ones(100), 0.15)
    edge = torch.cat([torch.full((15,), 0.69 / 15), torch.full((85,), 0.31 / 85)])
    assert coverage(edge, 0.15) == pytest.approx(0.69)
    assert len(run([a, a], score=torch.cat([torch.zeros(1), edge.flip(0), torch.zeros(3)]))[0]) == 100
    edge = torch.cat([torch.full((15,), 0.71 / 15), torch.full((85,), 0.29 / 85)])
    assert len(run([a, a], score=torch.cat([torch.zeros(1), edge.flip(0), torch.zeros(3)]))[0]) == 15


def test_lead_recomputes_the_first_reused_segment_first_then_by_the_question() -> None:
    cfg = tiny_models.llama_config()
    plan = make_plan(12, 2, [(2, 5, 0), (6, 9, 1)])
    policy = make_policy("attention")
    # The question attends most to 8 and 7; the lead segment (2..4) goes first whatever it scores, up
    # to half the budget, its own tokens by the question's attention (4, then 3, then 2).
    scores = torch.tensor([9.0, 9, 0.1, 0.2, 0.3, 9, 0.4, 5, 6, 9, 9, 9])

    def choose(task: RepairTask) -> tuple[int, ...]:
        probe = policy.decide(task).probe
        assert probe is not None
        probe.observer.score = scores.clone()  # type: ignore[attr-defined]
        return policy.choose(task, probe, None)

    assert choose(RepairTask(plan, 5, num_layers=4, model=cfg)) == (3, 4, 6, 7, 8)
    assert choose(RepairTask(plan, 4, num_layers=4, model=cfg)) == (3, 4, 7, 8)
    assert choose(RepairTask(plan, 2, num_layers=4, model=cfg)) == (4, 8)
    # The first segment came from the prefix cache (positions 0..5 exact): the second does not lead.
    later = RepairTask(make_plan(12, 6, [(2, 5, 0), (6, 9, 1)]), 2, num_layers=4, model=cfg)
    assert choose(later) == (7, 8)


@given(prompts(), st.data())
def test_leads_choice_is_the_oracles_and_nested_in_its_budget(case, data) -> None:
    """attention_choice against a brute-force statement of lead's rule, at every budget; the adaptive policy
    relies on the choice at a budget holding the choice at every smaller one."""
    from kvsplice.repair.attention import FIRST_SEGMENT_SHARE, attention_choice

    n, prefix, segments = case
    # The first segment spliced from its lead KV (computed at a prompt's start) neither leads nor is
    # ever chosen: its KV is exact.
    lead_kv = data.draw(st.booleans())
    plan = make_plan(n, prefix, segments, lead_kv=frozenset({0} if lead_kv else ()))
    spliced = plan.positions(SpanKind.SPLICED)
    if not spliced:
        return
    # Distinct scores: with ties the choice among equals is topk's, which no oracle can name.
    score = torch.tensor(data.draw(st.permutations(range(n))), dtype=torch.float32)
    first = plan.spliced()[0]
    exact = set(range(first.start, first.end)) if first.segment == 0 and lead_kv else set()
    candidates = [p for p in spliced if p not in exact]
    earlier: set[int] = set()
    for budget in range(len(candidates) + 1):
        led: list[int] = []
        if first.segment == 0 and not lead_kv:
            own = sorted(range(first.start, first.end), key=lambda p: -score[p])
            led = own[: int(FIRST_SEGMENT_SHARE * budget)]
        rest = sorted((p for p in candidates if p not in led), key=lambda p: -score[p])
        want = tuple(sorted(led + rest[: budget - len(led)]))
        got = attention_choice(plan, score, budget)
        assert got == want
        assert earlier <= set(got)
        earlier = set(got)


def test_each_adaptive_round_recomputes_leads_choice_at_its_budget_afresh() -> None:
    from kvsplice.repair.adaptive import AdaptiveRepair
    from kvsplice.repair.attention import attention_choice

    # Two reused segments of 50 (positions 1..50, 51..100) and a question (101..103); the question
    # attends most to the second segment's tokens, so only lead's half-share reaches the first.
    plan = make_plan(104, 1, [(1, 51, 0), (51, 101, 1)])
    first, second = torch.linspace(1, 2, 50), torch.linspace(10, 20, 50) ** 8
    score = torch.cat([torch.zeros(1), first, second, torch.zeros(3)])
    task = RepairTask(plan, 100, num_layers=4, model=tiny_models.llama_config())
    policy = AdaptiveRepair()
    probe = policy.decide(task).probe
    assert probe is not None
    probe.observer.score = score  # type: ignore[attr-defined]
    a, b = torch.tensor([2.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    rounds = [policy.choose(task, probe, a), policy.refine(task, b)]
    # Round 1 is lead's choice at 15: the first segment's seven most attended (44..50), then 93..100.
    assert rounds[0] == (*range(44, 51), *range(93, 101))
    # Round 2 is lead's choice at 30, round 1's tokens with it.
    assert rounds[1] == attention_choice(plan, score, 30) == (*range(36, 51), *range(86, 101))
    # A third would take 60, past half the reused tokens: every reused token instead.
    assert policy.refine(task, a) == tuple(range(1, 101))


def test_repair_passes_carry_the_segment_shift_of_the_approximate_segments() -> None:
    from kvsplice.reuse.repair_run import RepairRun

    # Positions 0-1 cached, 2-4 spliced from lead KV (exact), 6-8 spliced, 5 and 9-11 computed.
    plan = make_plan(12, 2, [(2, 5, 0), (6, 9, 1)], lead_kv=frozenset({0}))
    run = RepairRun(make_policy("boundary"), RepairTask(plan, 2, num_layers=4, shift=0.5))
    shift = run.first.shift
    assert shift is not None and shift.scale == 0.5
    assert list(shift.segments) == [(6, 7, 8)], "the lead KV's span is exact: no shift"
    assert shift.fresh == {layer: frozenset() for layer in range(4)}
    assert RepairRun(make_policy("boundary"), RepairTask(plan, 2, num_layers=4)).first.shift is None
    # A pass that recomputes no spliced token shifts nothing (the question probe's first pass).
    probe = RepairRun(
        make_policy("attention"),
        RepairTask(plan, 2, num_layers=4, model=tiny_models.llama_config(), shift=0.5),
    )
    assert probe.first.shift is None


def test_each_adaptive_round_leaves_alone_what_earlier_rounds_recomputed() -> None:
    from kvsplice.reuse.repair_run import RepairRun

    # As above: round 1 recomputes lead's choice at 15, round 2 at 30 (round 1's tokens with it).
    plan = make_plan(104, 1, [(1, 51, 0), (51, 101, 1)])
    score = torch.cat(
        [torch.zeros(1), torch.linspace(1, 2, 50), torch.linspace(10, 20, 50) ** 8, torch.zeros(3)]
    )
    task = RepairTask(plan, 100, num_layers=4, model=tiny_models.llama_config(), shift=1.0)
    run = RepairRun(make_policy("adaptive"), task)
    assert run.first.shift is None  # the probe: the question alone
    run.first.observer.score = score  # type: ignore[union-attr]
    first = run.next_pass(torch.tensor([2.0, 0.0, 0.0]))
    second = run.next_pass(torch.tensor([0.0, 2.0, 0.0]))
    assert first is not None and second is not None and first.shift is not None and second.shift is not None
    assert list(first.shift.segments) == [tuple(range(1, 51)), tuple(range(51, 101))]
    round_one = frozenset((*range(44, 51), *range(93, 101)))
    assert set(first.positions) >= round_one and first.shift.fresh == dict.fromkeys(range(4), frozenset())
    assert second.shift.fresh == dict.fromkeys(range(4), round_one)


@pytest.mark.parametrize("name", ["boundary", "deviation", "attention", "adaptive"])
@pytest.mark.parametrize("budget", [1, 3, 6])
def test_no_policy_recomputes_tokens_spliced_from_lead_kv(name: str, budget: int) -> None:
    """A segment spliced from its lead KV computed after the same head holds a full prefill's KV: budget
    spent on it would change nothing. The question's probe attends to it most here."""
    # Positions 0-1 computed (the head), 2-6 spliced from lead KV, 7-9 spliced, 10-11 the question.
    plan = make_plan(12, 0, [(2, 7, 0), (7, 10, 1)], lead_kv=frozenset({0}))
    assert plan.stale() == [7, 8, 9]
    policy = make_policy(name)
    task = RepairTask(plan, budget, num_layers=4, model=tiny_models.llama_config())
    decision = policy.decide(task)
    chosen = decision.recompute
    if decision.probe is not None:
        probe = decision.probe
        assert set(probe.positions) <= {7, 8, 9}, "nor probes them"
        probe.observer.score = torch.tensor([9.0, 9, 8, 8, 8, 8, 8, 0.1, 0.3, 0.2, 9, 9])  # type: ignore[attr-defined]
        chosen = policy.choose(task, probe, torch.zeros(4))
    assert chosen, f"{name} recomputes something within a budget of {budget}"
    assert set(chosen) <= {7, 8, 9}
    assert len(chosen) <= budget or not policy.budgeted
