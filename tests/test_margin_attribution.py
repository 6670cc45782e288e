"""The margin attribution (kv/attribution.py) against finite differences through the plain forward pass.

Its gradients come from autograd through the runner with the pool's KV read as leaves; the reference
perturbs single pool entries and runs the runner's inference path again, which equals transformers'
(tests/test_models.py). Both tiny families: a sliding window on some layers, grouped-query attention.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice.kv.attribution import MarginAttribution
from kvsplice.models.build import load_model
from kvsplice.models.flops import FlopModel
from kvsplice.models.runner import ForwardChunk, ModelRunner
from kvsplice.repair.base import Probe, RepairTask
from kvsplice.repair.margin import ATTRIBUTED_TOKENS, LEAD_BELOW, MarginRepair, probe_cost
from kvsplice.repair.query import QueryAttentionObserver
from kvsplice.repair.registry import make_policy
from kvsplice.reuse.plan import SpanKind, make_plan
from kvsplice.reuse.repair_run import RepairRun
from tests import tiny_models

LENGTH = 40
QUESTION = list(range(34, LENGTH))


@pytest.fixture(scope="module", params=["Gemma3ForCausalLM", "LlamaForCausalLM"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    directory = tmp_path_factory.mktemp(request.param)
    tiny_models.save(request.param, directory)
    return load_model(directory, torch.float32, torch.device("cpu"))


def _prefilled(model) -> tuple[ModelRunner, list[int], list[int]]:
    return tiny_models.prefilled_runner(model, LENGTH, seed=5)


def _question(
    runner: ModelRunner, table: list[int], ids: list[int], attribution: MarginAttribution
) -> ForwardChunk:
    """The question through every layer, attributed."""
    return ForwardChunk(
        table,
        QUESTION,
        [ids[p] for p in QUESTION],
        range(runner.num_layers),
        need_logits=True,
        attribution=attribution,
    )


def _attribute(runner: ModelRunner, table: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    attribution = MarginAttribution(LENGTH, tuple(QUESTION))
    result = runner.forward(_question(runner, table, ids, attribution))
    assert attribution.done and result.logits is not None and not result.logits.requires_grad
    return attribution.score, result.logits


def _margin(logits: torch.Tensor, top: torch.Tensor) -> float:
    logp = logits.double().log_softmax(-1)
    return float(logp[top[0]] - logp[top[1]])


def test_the_score_is_gradient_times_kv_by_finite_differences(model) -> None:
    runner, table, ids = _prefilled(model)
    score, logits = _attribute(runner, table, ids)
    top = logits.topk(2).indices
    slots = runner.pool.slots(table, torch.arange(LENGTH))
    step = 1e-2
    for position in (9, 30):
        expected = 0.0
        for tensors in (runner.pool.k, runner.pool.v):
            for layer in range(runner.num_layers):
                entry = tensors[layer, int(slots[position])]  # [Hkv, D], a view into the pool
                for index in range(entry.numel()):
                    value = float(entry.view(-1)[index])
                    margins = []
                    for sign in (1, -1):
                        entry.view(-1)[index] = value + sign * step
                        out = runner.prefill(table, ids, QUESTION).logits
                        margins.append(_margin(out, top))
                    entry.view(-1)[index] = value
                    expected += abs(value * (margins[0] - margins[1]) / (2 * step))
        assert float(score[position]) == pytest.approx(expected, rel=0.02, abs=1e-4)
    # The question's own slots are replaced by what it computes: nothing there to repair.
    assert float(score[QUESTION].abs().sum()) == 0.0


def test_the_attributed_pass_computes_what_the_plain_pass_does(model) -> None:
    runner, table, ids = _prefilled(model)
    plain = runner.prefill(table, ids, QUESTION).logits
    pool_k = runner.pool.k.clone()
    _, attributed = _attribute(runner, table, ids)
    torch.testing.assert_close(attributed, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(runner.pool.k, pool_k, atol=1e-5, rtol=1e-5)
    assert not runner.pool.k.requires_grad and not runner.pool.v.requires_grad


def test_an_attribution_scores_one_pass(model) -> None:
    runner, table, ids = _prefilled(model)
    chunk = _question(runner, table, ids, MarginAttribution(LENGTH, tuple(QUESTION)))
    runner.forward(chunk)
    with pytest.raises(AssertionError, match="one pass"):
        runner.forward(chunk)


@pytest.fixture
def free_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe costs nothing: the whole budget goes to the chosen (on prompts this short it would cost
    all of it, and the policy would probe as lead does)."""
    monkeypatch.setattr("kvsplice.repair.margin.probe_cost", lambda *args: 0)


def test_the_policy_chooses_the_first_segment_first_then_the_best_anywhere(free_probe) -> None:
    # Two segments of 10 spliced tokens after a 4-token head; the rest is computed.
    plan = make_plan(30, 0, [(4, 14, 0), (14, 24, 1)])
    task = RepairTask(plan, 6, num_layers=4, model=tiny_models.llama_config())
    policy = MarginRepair()
    probe = policy.decide(task).probe
    assert isinstance(probe, Probe) and probe.attribution is not None and probe.observer is None
    assert probe.last_layer == 3 and not probe.resume
    probe.attribution.score[:] = torch.arange(30, dtype=torch.float32)
    probe.attribution.done = True
    # Half the budget to the first segment's best (11-13), the rest to the best of all (21-23), not
    # the six best of all (18-23).
    assert policy.choose(task, probe, None) == (11, 12, 13, 21, 22, 23)


def _passes(plan, budget: int) -> list[tuple[tuple[int, ...], range, bool]]:
    """The margin run's passes on `plan` (positions, layers, attributed), its attribution scoring each
    position by its index."""
    run = RepairRun(MarginRepair(), RepairTask(plan, budget, num_layers=4, model=tiny_models.llama_config()))
    found = [run.first]
    while True:
        if found[-1].attribution is not None:
            found[-1].attribution.score[:] = torch.arange(plan.num_tokens, dtype=torch.float32)
            found[-1].attribution.done = True
        following = run.next_pass(None)
        if following is None:
            return [(p.positions, p.layers, p.attribution is not None) for p in found]
        found.append(following)


def test_the_question_runs_attributed_and_again_the_other_computed_tokens_once(free_probe) -> None:
    """No forward pass of the question before its attributed one (that pass writes its KV too), and after
    the choice only the question and the chosen run again: the other computed tokens keep what the
    first pass gave them."""
    # Positions 0-1 cached, 2-4 and 6-8 spliced, 5 (a separator) and 9-11 (the question) computed.
    plan = make_plan(12, 2, [(2, 5, 0), (6, 9, 1)])
    every = range(4)
    # Budget 2: one to the first segment's best (4), one to the best anywhere (8).
    assert _passes(plan, 2) == [
        ((5,), every, False),
        ((9, 10, 11), every, True),
        ((4, 8, 9, 10, 11), every, False),
    ]
    # Nothing computed but the question: the attributed pass comes first.
    plan = make_plan(12, 2, [(2, 5, 0), (5, 9, 1)])
    assert _passes(plan, 2) == [((9, 10, 11), every, True), ((4, 8, 9, 10, 11), every, False)]


def test_a_long_question_attributes_its_last_tokens_only(free_probe, monkeypatch: pytest.MonkeyPatch) -> None:
    """The question's earlier tokens run forward with the other computed ones; all of it runs again."""
    monkeypatch.setattr("kvsplice.repair.margin.ATTRIBUTED_TOKENS", 2)
    plan = make_plan(12, 2, [(2, 5, 0), (6, 9, 1)])
    every = range(4)
    assert _passes(plan, 2) == [
        ((5, 9), every, False),
        ((10, 11), every, True),
        ((4, 8, 9, 10, 11), every, False),
    ]


def _cost(policy: str, plan, budget: int, seed: int) -> tuple[float, int, bool]:
    """A repair run's FLOPs as the runner counts its passes (models/flops.py), how many spliced tokens it
    recomputed, and whether it attributed; every probe scores the positions at random."""
    cfg = tiny_models.llama_config()
    flops = FlopModel(cfg)
    run = RepairRun(make_policy(policy), RepairTask(plan, budget, num_layers=cfg.num_layers, model=cfg))
    scores = torch.rand(plan.num_tokens, generator=torch.Generator().manual_seed(seed))
    step, total, attributed = run.first, 0.0, False
    while step is not None:
        if step.attribution is not None:
            attributed = True
            total += flops.attributed(step.positions, step.layers)
            step.attribution.score[:] = scores
            step.attribution.done = True
        else:
            total += flops.forward(step.positions, step.layers)
            if isinstance(step.observer, QueryAttentionObserver):
                step.observer.score[:] = scores
        step = run.next_pass(None)
    assert run.recomputed is not None
    return total, len(run.recomputed), attributed


# Eight reused documents of 100 tokens after a head of 8, each followed by a separator of 2, then the
# question: the recall prompts' shape, scaled down.
DOCUMENTS = [(8 + 102 * i, 8 + 102 * i + 100, i) for i in range(8)]


@pytest.mark.parametrize("question", [6, 12])
@pytest.mark.parametrize("seed", range(3))
def test_margin_costs_what_lead_costs_at_the_same_budget(question: int, seed: int) -> None:
    """The probe's extra cost comes off the tokens margin recomputes: at the same budget both runs cost
    the same FLOPs, to within 2% of a full prefill's. Not exactly: the tokens it recomputes fewer are
    priced at the reused tokens' mean, and half of them are the first segment's, which attend to fewer
    keys. Here, where attention is most of a layer's cost, margin costs up to 1.2% of a full prefill
    more (without the price, 5% more); on the real models' shapes (recall prompts of 4 to 12 documents
    of 340 tokens) 0.1 to 0.4%."""
    plan = make_plan(8 + 102 * 8 + question, 0, DOCUMENTS)
    budget = round(0.15 * plan.tokens(SpanKind.SPLICED))
    lead, lead_count, _ = _cost("lead", plan, budget, seed)
    margin, margin_count, attributed = _cost("margin", plan, budget, seed)
    assert attributed and lead_count == budget
    assert LEAD_BELOW * budget <= margin_count < budget
    full = FlopModel(tiny_models.llama_config()).forward(range(plan.num_tokens), range(4))
    assert abs(margin - lead) <= 0.02 * full, (margin, lead, full)


def test_a_question_whose_probe_costs_half_the_budget_or_more_is_repaired_as_lead_would() -> None:
    """Few reused tokens under a long question: lead's probe and its choice at the whole budget."""
    plan = make_plan(8 + 102 * 2 + 40, 0, DOCUMENTS[:2])
    budget = round(0.15 * plan.tokens(SpanKind.SPLICED))
    assert (
        budget
        - probe_cost(
            RepairTask(plan, budget, num_layers=4, model=tiny_models.llama_config()),
            plan.question()[-ATTRIBUTED_TOKENS:],
            tuple(plan.stale()),
        )
        < LEAD_BELOW * budget
    )
    for seed in range(3):
        assert _cost("margin", plan, budget, seed) == (*_cost("lead", plan, budget, seed)[:2], False)
