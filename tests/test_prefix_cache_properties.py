"""Random request streams through both prefix caches, checked against an independent oracle.

Each stream mixes namespaces, prompts cut from a few shared bases (a three-token alphabet, so
prefixes overlap at every length and radix nodes split anywhere), decoding, several requests
running at once (so hash blocks get computed twice and radix paths stay locked) and a small block
budget (so caches evict and some requests abort for lack of memory). See prefix_cache_sim.py for
what is checked at every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.prefix_cache_sim import SimCounts, Simulator

TOKENS = st.integers(0, 2)


@dataclass(frozen=True)
class Workload:
    block_size: int
    page_size: int
    num_blocks: int
    max_running: int
    # (namespace, prompt, decode steps)
    requests: list[tuple[int, list[int], int]]
    seed: int


@st.composite
def workloads(draw: st.DrawFn, paged: bool) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    page_size = draw(st.sampled_from([1, 2, 3])) if paged else 1
    bases = draw(st.lists(st.lists(TOKENS, max_size=16), min_size=1, max_size=3))
    requests = []
    for _ in range(draw(st.integers(1, 24))):
        base = bases[draw(st.integers(0, len(bases) - 1))]
        cut = draw(st.integers(0, len(base)))
        suffix = draw(st.lists(TOKENS, min_size=1, max_size=6))
        requests.append((draw(st.integers(0, 2)), base[:cut] + suffix, draw(st.integers(0, 5))))
    # The longest request alone must fit (its prompt, decode, a copied partial block, slack).
    longest = max(len(prompt) + decode for _, prompt, decode in requests)
    need = -(-longest // block_size) + 2
    num_blocks = draw(st.integers(need, 3 * need))
    return Workload(block_size, page_size, num_blocks, draw(st.integers(1, 4)), requests, draw(st.integers()))


def simulate(kind: str, workload: Workload) -> SimCounts:
    """Admit requests in order and advance running ones in a seeded random interleaving."""
    rng = random.Random(workload.seed)
    sim = Simulator(kind, workload.num_blocks, workload.block_size, workload.page_size)
    pending = list(workload.requests)
    while pending or sim.running:
        if pending and len(sim.running) < workload.max_running and (not sim.running or rng.random() < 0.5):
            namespace, prompt, decode = pending.pop(0)
            sim.admit(namespace, prompt, decode)
        else:
            req = rng.choice(list(sim.running.values()))
            if not req.prefilled:
                sim.prefill(req, rng.randrange(3))
            elif req.decode_left:
                sim.decode(req, rng.randrange(3))
            else:
                sim.finish(req)
        sim.check()
    sim.drain()
    return sim.counts


PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(workloads(paged=False))
def test_hash_chain_matches_oracle(workload: Workload) -> None:
    simulate("hash", workload)


@PROPERTY
@given(workloads(paged=True))
def test_radix_matches_oracle(workload: Workload) -> None:
    simulate("radix", workload)


def test_streams_reach_the_interesting_cases() -> None:
    """The random streams above do exercise what they are meant to (a guard on the generator)."""
    rng = random.Random(0)
    totals = {"hash": SimCounts(), "radix": SimCounts()}
    for _ in range(40):
        bases = [[rng.randrange(3) for _ in range(rng.randint(0, 16))] for _ in range(3)]
        requests = []
        for _ in range(24):
            base = rng.choice(bases)
            prompt = base[: rng.randint(0, len(base))] + [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            requests.append((rng.randrange(3), prompt, rng.randint(0, 5)))
        block_size = rng.choice([2, 3, 4])
        num_blocks = rng.randint(-(-28 // block_size) + 2, 40)
        workload = Workload(block_size, rng.choice([1, 2]), num_blocks, 4, requests, rng.randrange(1 << 30))
        for kind, total in totals.items():
            counts = simulate(kind, workload)
            for name, value in vars(counts).items():
                setattr(total, name, getattr(total, name) + value)
    # Not radix > hash: vLLM indexes blocks as soon as they are computed, SGLang only when a
    # request finishes, so with several requests running at once the hash chain can hit more.
    assert totals["hash"].hit_tokens > 0 and totals["radix"].hit_tokens > 0
    assert totals["hash"].duplicate_blocks > 0
    assert totals["hash"].evicted_hash_blocks > 0
    assert totals["radix"].evicted_radix_leaves > 0
    assert totals["radix"].partial_hits > 0
    assert totals["hash"].aborted + totals["radix"].aborted > 0
    assert totals["hash"].finished > 0.8 * 40 * 24
