"""Workloads whose every turn extends the previous turn's prompt: chat and agent.

Replies are scripted (taken from the workload, not from the model), so that every system sees the
same prompts and the full prefill stays a valid reference; a real chat would append the model's own
reply, which the prefix caches would also hit.
"""

from __future__ import annotations

import random

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

CHAT_SYSTEM = "A conversation between a curious user and a helpful assistant who answers briefly.\n\n"
_FOLLOW_UPS = [
    "Which place names does it mention?",
    "When did the main events happen?",
    "Who are the people in it?",
    "Summarise it in one sentence.",
    "What is the most surprising detail?",
]


def chat(spec: WorkloadSpec) -> Workload:
    """`requests` conversations of `turns` turns. Even turns paste a passage from a small shared pool
    (so passages recur across conversations, at other positions); odd turns ask a follow-up. Every
    turn is measured: turn t's prompt is turn t-1's, plus the scripted reply and the new message."""
    assert spec.requests and spec.turns and spec.pool and spec.doc_words
    rng = random.Random(spec.seed)
    source = corpora.load(spec.source)
    texts = draw_pool(source.passages, spec.pool, spec.doc_words, rng)
    docs = [Doc(f"doc{i}", text + "\n\n") for i, text in enumerate(texts)]
    requests = []
    for c in range(spec.requests):
        parts: list[Part] = [CHAT_SYSTEM]
        pastes = (spec.turns + 1) // 2
        # A conversation pastes distinct passages while the pool has enough.
        pasted = (
            rng.sample(range(spec.pool), pastes)
            if pastes <= spec.pool
            else [rng.randrange(spec.pool) for _ in range(pastes)]
        )
        current = docs[0]
        for t in range(spec.turns):
            if t:
                parts.append(f" {_reply(current.text, t)}\n\n")
            if t % 2 == 0:
                current = docs[pasted[t // 2]]
                parts += ["User: Please read this text.\n\n", current, "What is it about?\nAssistant:"]
            else:
                parts.append(f"User: {rng.choice(_FOLLOW_UPS)}\nAssistant:")
            requests.append(BenchRequest(f"chat-{c}-{t}", tuple(parts), group=f"conv{c}", turn=t))
    return Workload(
        "chat",
        spec,
        tuple(requests),
        source.name,
        f"{spec.requests} conversations of {spec.turns} turns; each turn extends the previous prompt, "
        f"and every other turn pastes one of {spec.pool} shared passages",
    )


def _reply(text: str, turn: int) -> str:
    """A scripted reply: the turn-th sentence of the passage under discussion."""
    candidates = [s for s in corpora.sentences(text) if len(s.split()) >= 5] or [text.strip()]
    return candidates[min(turn, len(candidates) - 1)]


AGENT_SYSTEM = """You are a research agent. You work in steps. At each step you call exactly one tool,
read its result, and decide on the next call. When you have enough information, call `finish` with
a short report. Never invent facts that no tool returned.

Available tools:

search(query: str) -> list of passages
    Full-text search over the archive of local histories. Returns the best matching passage.
    Use short queries made of names; the search ignores punctuation and case.

read_page(title: str) -> str
    Returns the archive page with exactly this title. Fails if no page has this title.

lookup_date(event: str, place: str) -> str
    Returns the year in which an event happened in a place, when the archive records it.

compare(a: str, b: str) -> str
    Returns the differences between two passages, sentence by sentence.

note(text: str) -> None
    Stores a note for the final report. Notes are not visible to other tools.

finish(report: str) -> None
    Ends the task with the given report. The report must cite the passages it relies on.

Rules: one tool call per step, written as name(arguments). Quote string arguments. Keep the
queries short. If a tool fails, try a different query rather than the same call again.

"""


def agent(spec: WorkloadSpec) -> Workload:
    """Episodes of `turns` steps over a fixed system prompt with tool definitions: step s re-sends the
    tool calls and outputs of steps 0 .. s-1. Each episode draws its outputs (turns - 1 of them) from
    a shared pool, in a new order; warm-up episodes first carry every pool output once."""
    assert spec.requests and spec.turns and spec.pool and spec.doc_words
    if spec.turns < 2:
        raise ValueError("agent needs at least 2 steps per episode")
    per_episode = spec.turns - 1
    if spec.pool < per_episode:
        raise ValueError(f"the pool ({spec.pool}) must hold at least turns - 1 ({per_episode}) outputs")
    rng = random.Random(spec.seed)
    source = corpora.load(spec.source)
    texts = draw_pool(source.passages, spec.pool, spec.doc_words, rng)
    outputs = [Doc(f"out{i}", text + "\n\n") for i, text in enumerate(texts)]
    calls = [f'search(query="{" ".join(text.split()[:4]).strip(",.;:")}")' for text in texts]
    warm = warmup_orders(spec.pool, per_episode, rng)
    measured = new_orders(spec.pool, per_episode, spec.requests, {tuple(d) for d in warm}, rng)
    requests = []
    for e, draw in enumerate(warm + measured):
        parts: list[Part] = [
            AGENT_SYSTEM,
            f"Task {e}: collect what the archive says about the sources below and write a short report.\n\n",
        ]
        for s in range(spec.turns):
            if s:
                j = draw[s - 1]
                parts += [f"Step {s}: {calls[j]}\nResult:\n", outputs[j]]
            step_parts = (*parts, f"Step {s + 1}:")
            requests.append(
                BenchRequest(f"agent-{e}-{s}", step_parts, warmup=e < len(warm), group=f"ep{e}", turn=s)
            )
    return Workload(
        "agent",
        spec,
        tuple(requests),
        source.name,
        f"episodes of {spec.turns} steps over a fixed system prompt with tool definitions; each step "
        f"re-sends the history, whose tool outputs come from a pool of {spec.pool} shared passages",
    )
