"""Where a router sends bench traffic's requests, and how many of their passages that replica holds.

An offline simulation (no model, no timing) over the request stream of `kvsplice bench traffic`
(kvsplice/bench/traffic_workload.py: k passages drawn with Zipf popularity, a question), for 2 and 4
replicas. A replica holds a passage once a request carrying it was routed there (pools large enough
to keep everything; no eviction). Routing policies:

    round_robin  request i to replica i mod N
    cache_aware  vllm-router's: the replica whose earlier prompts share the longest character prefix
                 with this one if that prefix is over CACHE_THRESHOLD of the prompt, else the one with
                 the fewest cached characters. Its load balancing needs (max - min) in-flight
                 requests > 64, which traffic at a few requests/s never reaches, so it is left out.
    segment      the replica holding most of the request's passages, wherever they sit in the prompt,
                 among the replicas within SLACK requests of the least loaded (ties: the least loaded).
                 What a router scoring kvsplice's segment events could do (docs/routing.md).

Printed per mix and replica count: the share of passage slots whose passage the chosen replica held
(an in-pool segment hit), the share some replica held (with a shared Redis tier every one of those is
a hit too, loaded from Redis), and the busiest replica's share of requests.

    python bench/routing_sim.py [--requests 240] [--out bench/results/routing_sim.md]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvsplice.bench import corpus as corpora
from kvsplice.bench.traffic_workload import MIXES, TrafficRequest, build_requests

# vllm-router's --cache-threshold default: the matched share of a prompt's characters above which
# cache_aware follows the match.
CACHE_THRESHOLD = 0.3
# How many requests more than the least loaded replica the segment-aware choice may send to one.
SLACK = 2


@dataclass
class Replica:
    passages: set[int] = field(default_factory=set)
    prompts: list[str] = field(default_factory=list)
    cached_chars: int = 0
    requests: int = 0


def prompt_text(request: TrafficRequest) -> str:
    return "".join(m["content"] for m in request.messages)


def matched_prefix(replica: Replica, text: str) -> int:
    # Characters, not path components: the router's tree matches request text character by character.
    return max((len(os.path.commonprefix([p, text])) for p in replica.prompts), default=0)  # noqa: RUF071


Policy = Callable[[list[Replica], TrafficRequest, int], int]


def round_robin(replicas: list[Replica], request: TrafficRequest, i: int) -> int:
    return i % len(replicas)


def cache_aware(replicas: list[Replica], request: TrafficRequest, i: int) -> int:
    text = prompt_text(request)
    matches = [matched_prefix(r, text) for r in replicas]
    best = max(range(len(replicas)), key=matches.__getitem__)
    if matches[best] / len(text) > CACHE_THRESHOLD:
        return best
    return min(range(len(replicas)), key=lambda j: replicas[j].cached_chars)


def segment_aware(replicas: list[Replica], request: TrafficRequest, i: int) -> int:
    least = min(r.requests for r in replicas)
    eligible = [j for j, r in enumerate(replicas) if r.requests <= least + SLACK]
    held = [len(replicas[j].passages & set(request.passage_ids)) for j in eligible]
    return max(zip(held, eligible, strict=True), key=lambda hj: (hj[0], -replicas[hj[1]].requests))[1]


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "cache_aware": cache_aware,
    "segment": segment_aware,
}


@dataclass(frozen=True)
class Outcome:
    on_replica: float  # passage slots the chosen replica held
    anywhere: float  # passage slots some replica held (a Redis hit when it is not on the chosen one)
    busiest: float  # the busiest replica's share of requests


def simulate(requests: list[TrafficRequest], n: int, policy: Policy) -> Outcome:
    replicas = [Replica() for _ in range(n)]
    on = anywhere = slots = 0
    for i, request in enumerate(requests):
        chosen = replicas[policy(replicas, request, i)]
        seen = set().union(*(r.passages for r in replicas))
        on += sum(p in chosen.passages for p in request.passage_ids)
        anywhere += sum(p in seen for p in request.passage_ids)
        slots += len(request.passage_ids)
        text = prompt_text(request)
        chosen.cached_chars += len(text) - matched_prefix(chosen, text)
        chosen.prompts.append(text)
        chosen.passages |= set(request.passage_ids)
        chosen.requests += 1
    assert sum(r.requests for r in replicas) == len(requests)
    return Outcome(on / slots, anywhere / slots, max(r.requests for r in replicas) / len(requests))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, nargs="+", default=[24, 240], help="stream lengths")
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--doc-words", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/routing_sim.md"))
    args = parser.parse_args()
    source = corpora.load("auto")
    lines = [
        "# Routing bench traffic's requests: the passages the chosen replica holds",
        "",
        f"Command: `python bench/routing_sim.py --requests {' '.join(map(str, args.requests))} "
        f"--docs {args.docs} "
        f"--doc-words {args.doc_words} --seed {args.seed}`; passages from the {source.name} corpus. "
        "An offline simulation (bench/routing_sim.py says how each policy chooses): no model, no timing.",
        "",
        "| mix | requests | replicas | policy | passages on the chosen replica | passages on some replica "
        "| busiest replica's requests |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for mix in MIXES.values():
        for count in args.requests:
            requests = build_requests(mix, count, args.docs, args.doc_words, args.seed, source)
            for n in (2, 4):
                for name, policy in POLICIES.items():
                    o = simulate(requests, n, policy)
                    lines.append(
                        f"| {mix.name} | {count} | {n} | {name} | {o.on_replica:.0%} | {o.anywhere:.0%} "
                        f"| {o.busiest:.0%} |"
                    )
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
