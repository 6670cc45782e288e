"""A request sent the moment a cold one has answered, against the same documents on an idle engine,
in-process (bench/results/cold_traffic.md).

The engine is stepped by hand so that the reordered request is added while the cold request's store
copies are still queued: its first token must not wait for them. The server benchmark
(bench/cold_traffic.py) measures the same through HTTP, with more noise.

    python bench/after_cold_inprocess.py [--pairs 3] [--num-threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics

from cold_traffic import INSTRUCTION, QUESTION  # the server benchmark's prompts (bench/ is on the path)

from kvsplice import LLM, SamplingParams
from kvsplice.bench import corpus
from kvsplice.engine.engine import Engine
from kvsplice.outputs import RequestOutput
from kvsplice.prompt import Segment

PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


def _prompt(docs: list[str]) -> list:
    parts: list = [INSTRUCTION]
    for doc in docs:
        parts += [Segment(doc), "\n\n"]
    return [*parts, QUESTION]


def _run_until_done(engine: Engine, request_id: str) -> RequestOutput:
    while True:
        for out in engine.step():
            if out.output is not None and out.output.request_id == request_id:
                return out.output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--num-threads", type=int, default=2)
    args = parser.parse_args()
    rng = random.Random(2)
    passages = [p for p in corpus.load("musique").passages if len(p.text.split()) >= 60]
    texts = iter(f"{p.title}\n{corpus.trim(p.text, 180)}" for p in rng.sample(passages, len(passages)))
    llm = LLM(prefix_cache="radix", num_threads=args.num_threads)
    engine = llm.engine
    llm.generate([_prompt([next(texts) for _ in range(6)])], PARAMS)  # warm-up
    after, idle = [], []
    for pair in range(args.pairs):
        docs = [next(texts) for _ in range(6)]
        _run_until_done(engine, engine.add_request(_prompt(docs), PARAMS))
        queued = engine.background.busy
        order = rng.sample(docs, len(docs))
        right_after = _run_until_done(engine, engine.add_request(_prompt(order), PARAMS))
        while engine.has_unfinished():
            engine.step()
        on_idle = llm.generate([_prompt(rng.sample(docs, len(docs)))], PARAMS)[0]
        after.append(right_after.metrics.ttft_s)
        idle.append(on_idle.metrics.ttft_s)
        print(
            f"pair {pair}: copies queued {queued}; right after {after[-1]:.3f} s "
            f"({right_after.metrics.segment_hit_tokens} segment tokens), idle {idle[-1]:.3f} s "
            f"({on_idle.metrics.segment_hit_tokens})",
            flush=True,
        )
    print(f"median right after / idle: {statistics.median(after) / statistics.median(idle):.2f}x")


if __name__ == "__main__":
    main()
