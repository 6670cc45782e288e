"""The real server on a free loopback port, driven by the official `openai` client (raw httpx only for
inputs the client cannot send). One server with the default model for the session (conftest.py);
generations are short. Refusals and failures: test_server_errors.py."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from kvsplice.server.launch import ServerThread
from tests.server_support import engine_of, metrics, wait_idle
from tests.test_splice_default import DOCS as PASSAGES

pytestmark = pytest.mark.slow

DOCS = [
    "Nile: the longest river in Africa, flowing north into the Mediterranean Sea.",
    "Kilimanjaro: a mountain in Tanzania, the highest on the African continent.",
    "Sahara: the largest hot desert in the world, spanning much of North Africa.",
]
SYSTEM = "You answer questions using only the documents the user gives you."


# -- basics ---------------------------------------------------------------------------------------


def test_models_and_health(server: ServerThread, client: openai.OpenAI, model: str) -> None:
    assert model == "gemma-3-270m-q4_k_m"
    assert httpx.get(server.url + "/health").status_code == 200
    card = client.models.list().data[0]
    assert card.object == "model" and card.owned_by == "kvsplice"


def test_completion(client: openai.OpenAI, model: str, server: ServerThread) -> None:
    tokenizer = engine_of(server).tokenizer
    assert tokenizer is not None
    text = "The capital of France is"
    r = client.completions.create(model=model, prompt=text, max_tokens=4, temperature=0)
    (choice,) = r.choices
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert choice.text and choice.finish_reason == "length"
    assert r.usage is not None
    assert r.usage.prompt_tokens == 1 + len(tokenizer.encode(text))  # BOS
    assert r.usage.completion_tokens == 4
    # The same prompt as token ids gives the same greedy text.
    ids = [tokenizer.bos_token_id, *tokenizer.encode(text)]
    again = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert again.choices[0].text == choice.text


def test_batch_completion_and_token_ids(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model,
        prompt=["One, two,", "Red, green,"],
        max_tokens=3,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        extra = c.model_extra or {}
        assert len(extra["token_ids"]) == 3 and extra["prompt_token_ids"][0] == 2
    assert r.usage is not None and r.usage.completion_tokens == 6


def test_chat_has_exactly_one_bos(client: openai.OpenAI, model: str, server: ServerThread) -> None:
    tokenizer = engine_of(server).tokenizer
    assert tokenizer is not None
    messages: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hello."}]
    r = client.chat.completions.create(
        model=model, messages=messages, max_tokens=3, temperature=0, extra_body={"return_token_ids": True}
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    ids = (r.model_extra or {})["prompt_token_ids"]
    bos = tokenizer.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1
    # The rendered template, tokenised as a whole, is the same prompt.
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(messages))
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_streaming_completion_matches(client: openai.OpenAI, model: str) -> None:
    kwargs: Any = dict(model=model, prompt="Once upon a time", max_tokens=5, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


def test_streaming_chat_matches(client: openai.OpenAI, model: str) -> None:
    kwargs: Any = dict(
        model=model, messages=[{"role": "user", "content": "Name a color."}], max_tokens=5, temperature=0
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chunks)


# -- segments -------------------------------------------------------------------------------------


def _ask_documents(client: openai.OpenAI, model: str, question: str, docs: list[str], **extra: Any) -> Any:
    """A two-token chat answer over `docs` (kvsplice's `documents`, reusable segments); its usage."""
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        extra_body={"documents": docs, **extra},
    ).usage


def test_a_near_tie_after_repair_is_prefilled_in_full(
    client: openai.OpenAI, model: str, server: ServerThread
) -> None:
    def ask(docs: list[str], margin: float) -> Any:
        return _ask_documents(
            client, model, "Which is oldest?", docs, cache_salt="fallback", repair_fallback_margin=margin
        )

    assert ask(DOCS, 0.0).repair_fallbacks == 0
    wait_idle(server)
    before = metrics(server).get("kvsplice:repair_fallbacks_total", 0.0)
    # A margin of 1: every first token is a near-tie, so every stale reused token is recomputed.
    torn = ask([DOCS[1], DOCS[2], DOCS[0]], 1.0)
    assert torn.segment_hit_tokens > 0 and torn.repair_fallbacks == 1
    assert torn.recomputed_tokens == torn.segment_hit_tokens - torn.segment_lead_tokens
    assert metrics(server)["kvsplice:repair_fallbacks_total"] == before + 1


def test_chat_documents_reordered_hit_the_segment_store(
    client: openai.OpenAI, model: str, server: ServerThread
) -> None:
    def ask(docs: list[str], salt: str) -> Any:
        return _ask_documents(client, model, "Which document mentions a desert?", docs, cache_salt=salt)

    first = ask(DOCS, "tenant-a")
    assert first.segment_hit_tokens == 0 and first.segment_lead_tokens == 0
    wait_idle(server)  # the store's background work: the documents' KV, and their lead KV
    second = ask([DOCS[2], DOCS[0], DOCS[1]], "tenant-a")
    tokenizer = engine_of(server).tokenizer
    assert tokenizer is not None
    doc_tokens = [len(tokenizer.encode(d)) for d in DOCS]
    assert second.segment_hit_tokens > 0
    assert second.segment_hit_tokens <= sum(doc_tokens)
    # Only the leading text before the first document is shared as a prefix.
    leading = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "X"}]
    ).split("X")[0]
    assert 0 < second.prefix_hit_tokens <= len(tokenizer.encode(leading))
    assert second.prompt_tokens_details.cached_tokens == second.prefix_hit_tokens + second.segment_hit_tokens
    assert second.recomputed_tokens <= second.segment_hit_tokens
    # DOCS[2] now opens the documents, after the same head as in the first request. Seen once, it has
    # no lead KV (only DOCS[0], which opened the first request, has it, copied from there): this request
    # has it computed, and the next that opens with it splices it from there, exact.
    assert second.segment_lead_tokens == 0
    wait_idle(server)
    third = ask([DOCS[2], DOCS[1], DOCS[0]], "tenant-a")
    assert third.segment_lead_tokens == doc_tokens[2]
    # Another tenant shares nothing.
    other = ask([DOCS[2], DOCS[0], DOCS[1]], "tenant-b")
    assert other.segment_hit_tokens == 0 and other.prefix_hit_tokens == 0
    m = metrics(server)
    assert m["kvsplice:segment_hit_tokens_total"] >= second.segment_hit_tokens
    assert m["kvsplice:segment_store_hits_total"] >= 3


def test_completion_segments_with_repair_options(client: openai.OpenAI, model: str) -> None:
    def ask(order: list[int], **extra: Any) -> Any:
        parts = [{"text": "Context:\n"}]
        for i in order:
            parts += [{"segment": DOCS[i]}, {"text": "\n"}]
        parts.append({"text": "Question: which river flows north?\nAnswer:"})
        return client.completions.create(
            model=model,
            prompt=parts,  # type: ignore[arg-type]
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": "parts", **extra},
        ).usage

    ask([0, 1, 2])
    full = ask([1, 2, 0], repair="full")
    assert full.segment_hit_tokens > 0 and full.recomputed_tokens == full.segment_hit_tokens
    capped = ask([2, 0, 1], repair="boundary", recompute_ratio=0.01)
    assert capped.segment_hit_tokens > 0
    assert capped.recomputed_tokens == round(0.01 * capped.segment_hit_tokens) < full.recomputed_tokens
    none = ask([2, 1, 0], repair="none")
    assert none.segment_hit_tokens > 0 and none.recomputed_tokens == 0


def test_chat_segment_content_part(client: openai.OpenAI, model: str) -> None:
    def ask(first: int, second: int) -> Any:
        content = [
            {"type": "text", "text": DOCS[first], "kvsplice_segment": True},
            {"type": "text", "text": DOCS[second], "kvsplice_segment": True},
            {"type": "text", "text": "Which mountain is highest?"},
        ]
        return client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],  # type: ignore[list-item]
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": "parts-chat"},
        ).usage

    ask(0, 1)
    assert ask(1, 0).segment_hit_tokens > 0


def test_plain_chat_messages_with_passages_in_a_new_order_reuse_them(
    client: openai.OpenAI, model: str, server: ServerThread
) -> None:
    """No markup: the passages are pasted into a plain user message; auto_segments finds them."""

    def ask(order: list[int], salt: str) -> Any:
        passages = "".join(PASSAGES[i] + "\n\n" for i in order)
        return client.chat.completions.create(
            model=model,
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": passages + "Who founded the Larkspur Observatory?"},
            ],
            max_tokens=2,
            temperature=0,
            extra_body={"cache_salt": salt},
        ).usage

    first = ask([0, 1, 2], "plain-a")
    assert first.discovered_hit_tokens == 0
    before = metrics(server)["kvsplice:discovered_hit_tokens_total"]
    second = ask([2, 0, 1], "plain-a")
    # Most of the two passages that do not lead (the first after the prefix may too): ~120 tokens each.
    assert second.discovered_hit_tokens >= 200 and second.segment_hit_tokens == 0
    cached = second.prompt_tokens_details.cached_tokens
    assert cached == second.prefix_hit_tokens + second.discovered_hit_tokens
    assert metrics(server)["kvsplice:discovered_hit_tokens_total"] - before == second.discovered_hit_tokens
    # Another tenant sent the first order too, but tenants never share.
    assert ask([1, 2, 0], "plain-b").discovered_hit_tokens == 0


# -- concurrency and cancellation -----------------------------------------------------------------


def test_16_concurrent_clients(server: ServerThread, model: str) -> None:
    prompts = [f"Fact number {i}: the" for i in range(4)]
    async_client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300
    )

    async def one(prompt: str) -> str:
        r = await async_client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
        return r.choices[0].text

    async def run() -> tuple[list[str], list[str]]:
        expected = [await one(p) for p in prompts]  # one at a time
        answers = await asyncio.gather(*(one(prompts[i % 4]) for i in range(16)))
        await async_client.close()
        return expected, list(answers)

    before = metrics(server)["vllm:request_success_total{finished_reason=length}"]
    expected, answers = asyncio.run(run())
    assert answers == [expected[i % 4] for i in range(16)]
    after = metrics(server)["vllm:request_success_total{finished_reason=length}"]
    assert after - before == 20


def test_disconnects_cancel_and_free_blocks(server: ServerThread, model: str) -> None:
    baseline = wait_idle(server)
    aborted = baseline.get("vllm:request_success_total{finished_reason=abort}", 0)
    body = {"model": model, "prompt": "Count: one, two,", "max_tokens": 500, "ignore_eos": True}
    # A streaming client that reads two chunks and hangs up.
    with (
        httpx.Client(base_url=server.url, timeout=120) as http,
        http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert next(line for line in lines if line.startswith("data:"))
        running = metrics(server)
        assert running["vllm:num_requests_running"] == 1
        # KV for the whole request (prompt + 500 tokens) is reserved while it runs.
        assert running["kvsplice:kv_cache_request_blocks"] >= 500 // 16
    after = wait_idle(server)
    assert after["vllm:request_success_total{finished_reason=abort}"] == aborted + 1
    # Whatever the prefix cache keeps of it is at most the blocks of its few computed tokens.
    assert after["kvsplice:kv_cache_used_blocks"] <= baseline["kvsplice:kv_cache_used_blocks"] + 2
    # A non-streaming client that gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=3)
    after = wait_idle(server)
    assert after["vllm:request_success_total{finished_reason=abort}"] == aborted + 2
    assert after["vllm:generation_tokens_total"] - baseline["vllm:generation_tokens_total"] < 500


def test_metrics_names(server: ServerThread, client: openai.OpenAI, model: str) -> None:
    # A request of its own, so the counters have moved when this test runs alone.
    before = wait_idle(server)
    client.completions.create(
        model=model, prompt="Metrics, please:", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    m = wait_idle(server)
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "kvsplice:prefix_hit_tokens_total",
        "kvsplice:segment_hit_tokens_total",
        "kvsplice:discovered_hit_tokens_total",
        "kvsplice:recomputed_tokens_total",
        "kvsplice:segment_store_entries",
        "kvsplice:background_jobs_queued",
        "kvsplice:segment_store_context_tokens_total",
        "kvsplice:segment_store_contexts_dropped_total",
        "kvsplice:segment_store_lead_tokens_total",
        "kvsplice:segment_store_lead_hit_tokens_total",
        "kvsplice:background_jobs_queued",
        "kvsplice:prefill_flops_total",
        "kvsplice:decode_flops_total",
        "kvsplice:background_tokens_total",
        "kvsplice:background_flops_total",
        "kvsplice:audit_tokens_total",
        "kvsplice:audit_flops_total",
    ]:
        assert name in m, name
    assert m["vllm:prompt_tokens_total"] > 0 and m["vllm:time_to_first_token_seconds_count"] > 0

    # The runner's count of what it computed, against the requests' own accounts: every prompt token
    # computed or recomputed ran through the model at least once (probes run some twice), and every
    # generated token but each request's first (its prefill's) was a decode step.
    def moved(name: str) -> float:
        return m[name] - before.get(name, 0.0)

    computed = moved("kvsplice:computed_prompt_tokens_total") + moved("kvsplice:recomputed_tokens_total")
    assert moved("kvsplice:prefill_tokens_total") >= computed > 0
    assert moved("kvsplice:decode_tokens_total") == moved("vllm:generation_tokens_total") - 1 == 2
    assert moved("kvsplice:prefill_flops_total") > moved("kvsplice:decode_flops_total") > 0
    assert 0 <= m["vllm:kv_cache_usage_perc"] <= 1
