"""The live audit (engine/audit.py) against an independent full prefill: what the engine records for the
spliced requests it audits equals a direct comparison with a plain engine's full prefill of the same
prompts. Tiny random-weight models, token-id prompts."""

from __future__ import annotations

import math
import random
from pathlib import Path

import httpx
import pytest

from kvsplice import LLM, RequestOptions, SamplingParams, Segment
from kvsplice.config import EngineConfig
from kvsplice.engine.audit import KL_BUCKETS, AuditResult, AuditSchedule
from kvsplice.engine.engine import Engine
from kvsplice.sampling import kl_divergence
from kvsplice.server.launch import ServerThread
from tests import tiny_models
from tests.server_support import metrics, wait_idle

rng = random.Random(7)
SYSTEM = [rng.randrange(1, 320) for _ in range(9)]
DOCS = [[rng.randrange(1, 320) for _ in range(40)] for _ in range(4)]
QUESTION = [rng.randrange(1, 320) for _ in range(6)]
FIRST = SamplingParams(max_tokens=1, temperature=0.0, return_first_logits=True)
SETTINGS = {"block_size": 8, "kv_cache_gb": 0.01, "num_threads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("LlamaForCausalLM")
    tiny_models.save("LlamaForCausalLM", directory)
    return directory


def test_the_schedule_audits_its_share_without_a_draw() -> None:
    for ratio, n in ((0.02, 1000), (0.3, 100), (1.0, 7), (0.0, 50)):
        schedule = AuditSchedule(ratio)
        picked = [i + 1 for i in range(n) if schedule.pick()]
        assert len(picked) == math.floor(n * ratio)
    every_50th = AuditSchedule(0.02)
    assert [i + 1 for i in range(150) if every_50th.pick()] == [50, 100, 150]


def test_the_audit_records_what_a_direct_full_prefill_comparison_gives(model_dir: Path) -> None:
    audited = LLM(model=str(model_dir), prefix_cache="radix", audit_ratio=1.0, **SETTINGS)
    plain = LLM(model=str(model_dir), prefix_cache="off", **SETTINGS)
    audited.generate([[SYSTEM, *map(Segment, DOCS), QUESTION]], FIRST)
    kls, agree, prompts = [], 0, 0
    orders = ([2, 0, 3, 1], [1, 3], [3, 2, 1, 0], [0, 2])
    for i, order in enumerate(orders):
        # Unrepaired (known damage) and repaired; each order opens with another document, so no request
        # takes another's spliced KV as its prefix.
        options = RequestOptions(repair="none" if i % 2 else "attention")
        got = audited.generate([[SYSTEM, *(Segment(DOCS[d]) for d in order), QUESTION]], FIRST, options)[0]
        assert got.metrics.segment_hit_tokens > 0
        prompts += len(got.prompt_token_ids)
        want = plain.generate([[*SYSTEM, *(t for d in order for t in DOCS[d]), *QUESTION]], FIRST)[0]
        assert got.first_logits is not None and want.first_logits is not None
        kls.append(kl_divergence(want.first_logits, got.first_logits))
        agree += int(want.first_logits.argmax()) == int(got.first_logits.argmax())
    # The audits run as background work, after the requests.
    before = audited.engine.stats()
    assert sum(c.requests for c in before.audits) < len(orders)
    while audited.engine.has_unfinished():
        audited.engine.step()
    stats = audited.engine.stats()
    assert stats.background_tokens > before.background_tokens
    # Each audit prefilled its whole prompt (one first token each: nothing decoded), counted apart.
    assert stats.audit_tokens == prompts and stats.audit_flops > 0
    assert sum(c.requests for c in stats.audits) == len(orders) and stats.audits_dropped == 0
    assert sum(c.agreements for c in stats.audits) == agree
    assert sum(c.kl_sum for c in stats.audits) == pytest.approx(sum(kls), rel=1e-4, abs=1e-7)
    assert max(kls) > 1e-4, "the unrepaired requests are not exact: the audit has damage to see"
    within = sum(c.kl_buckets[KL_BUCKETS.index(0.05)] for c in stats.audits)
    assert within == sum(kl <= 0.05 for kl in kls)
    # Off, nothing is audited.
    quiet = LLM(model=str(model_dir), prefix_cache="radix", audit_ratio=0.0, fidelity_target=0.0, **SETTINGS)
    quiet.generate([[SYSTEM, *map(Segment, DOCS), QUESTION]], FIRST)
    quiet.generate([[SYSTEM, *(Segment(DOCS[d]) for d in (1, 0)), QUESTION]], FIRST)
    while quiet.engine.has_unfinished():
        quiet.engine.step()
    assert quiet.engine.stats().audits == ()


def _leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_the_audit_counts_the_answer_tokens_a_full_prefill_decodes_too(model_dir: Path) -> None:
    answer = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    audited = LLM(model=str(model_dir), prefix_cache="off", audit_ratio=1.0, fidelity_target=0.0, **SETTINGS)
    plain = LLM(model=str(model_dir), prefix_cache="off", **SETTINGS)
    audited.generate([[SYSTEM, *map(Segment, DOCS), QUESTION]], answer)
    agreeing, same = [], 0
    for i, order in enumerate(([2, 0, 3, 1], [1, 3, 0, 2], [3, 2, 1, 0], [0, 2, 1, 3])):
        options = RequestOptions(repair="none" if i % 2 else "attention")
        got = audited.generate([[SYSTEM, *(Segment(DOCS[d]) for d in order), QUESTION]], answer, options)[0]
        want = plain.generate([[*SYSTEM, *(t for d in order for t in DOCS[d]), *QUESTION]], answer)[0]
        agreeing.append(_leading_agreement(got.token_ids, want.token_ids))
        same += got.token_ids == want.token_ids
    while audited.engine.has_unfinished():
        audited.engine.step()
    cells = audited.engine.stats().audits
    assert sum(c.continuations for c in cells) == 4
    assert sum(c.agreeing_tokens for c in cells) == sum(agreeing)
    assert sum(c.same_continuations for c in cells) == same
    assert min(agreeing) < 6, "some answer diverges from the full prefill's: the audit has one to count"


def test_a_request_that_asks_gets_its_own_audit_before_it_returns(model_dir: Path) -> None:
    answer = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, return_first_logits=True)
    llm = LLM(model=str(model_dir), prefix_cache="off", audit_ratio=0.0, fidelity_target=0.0, **SETTINGS)
    plain = LLM(model=str(model_dir), prefix_cache="off", **SETTINGS)
    first = llm.generate([[SYSTEM, *map(Segment, DOCS), QUESTION]], answer, RequestOptions(audit=True))[0]
    # Nothing was reused: the answer was a full prefill's, and the audit says so without computing.
    assert first.metrics.audit == AuditResult(0.0, True, 5, 5)
    order = [3, 1, 0, 2]
    asked = RequestOptions(repair="none", audit=True)
    got = llm.generate([[SYSTEM, *(Segment(DOCS[d]) for d in order), QUESTION]], answer, asked)[0]
    want = plain.generate([[*SYSTEM, *(t for d in order for t in DOCS[d]), *QUESTION]], answer)[0]
    audit = got.metrics.audit
    assert audit is not None and got.first_logits is not None and want.first_logits is not None
    assert audit.first_token_kl == pytest.approx(kl_divergence(want.first_logits, got.first_logits), abs=1e-6)
    assert audit.first_token_kl > 1e-4, "unrepaired: the audit has damage to see"
    assert audit.agreeing_tokens == _leading_agreement(got.token_ids, want.token_ids)
    # Not asked, not scheduled: no audit.
    plain_options = RequestOptions(repair="none")
    got = llm.generate([[SYSTEM, *(Segment(DOCS[d]) for d in [2, 3, 1, 0]), QUESTION]], answer, plain_options)
    assert got[0].metrics.audit is None


def test_the_server_reports_the_audit(model_dir: Path) -> None:
    engine = Engine(EngineConfig(model=str(model_dir), prefix_cache="radix", audit_ratio=1.0, **SETTINGS))
    with ServerThread(engine) as server:

        def ask(order: list[int], salt: str) -> None:
            prompt = [{"token_ids": SYSTEM}, *({"segment": DOCS[d]} for d in order), {"token_ids": QUESTION}]
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200

        ask([0, 1, 2], "tenant-a")
        ask([2, 1, 0], "tenant-a")
        prompt = [{"token_ids": SYSTEM}, *({"segment": DOCS[d]} for d in (1, 2, 0)), {"token_ids": QUESTION}]
        body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "cache_salt": "tenant-b", "audit": True}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        (own,) = reply["usage"]["audit"]
        assert own["first_token_kl"] >= 0 and own["compared_tokens"] == 3 and 0 <= own["agreeing_tokens"] <= 3
        wait_idle(server)
        audit = httpx.get(f"{server.url}/audit", timeout=10).json()
        assert audit["audit_ratio"] == 1.0 and audit["dropped"] == 0
        (cell,) = audit["cells"]
        assert (cell["salt"], cell["shape"], cell["requests"]) == ("salt:tenant-a", "2-4 x <128 marked", 1)
        (gate,) = audit["gate"]
        assert gate["cell"] == "2-4 x <128 marked, attention@15%"
        assert (gate["samples"], gate["fallback_below_margin"]) == (1, None)
        assert cell["kl_mean"] >= 0.0 and 0.0 <= cell["first_token_agreement"] <= 1.0
        m = metrics(server)
        assert any(k.startswith("kvsplice:audit_first_token_kl_bucket") for k in m)
        assert sum(v for k, v in m.items() if k.startswith("kvsplice:audit_requests_total")) == 1
