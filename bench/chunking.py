"""Content-defined chunking and the span index on real text: what they find, what they cost, their size.

Text: MuSiQue passages (read from ../shared/data/musique_s.json at run time) and kvsplice's synthetic
corpus, tokenized with the default model's tokenizer (Gemma 3) a whole prompt at a time, so a pasted
passage's edge tokens merge with their neighbours as they would in a real request.

- sources: earlier RAG prompts, each six passages and a question in Gemma's chat format;
- rag prompts: six passages each, four that sources carried (in another order, numbered and
  introduced differently) and two that none did;
- quote prompts: single sentences of passages that sources carried, quoted between new text: the
  short shared spans (10-80 tokens) on which chunk sizes matter;
- fresh prompts: 4,096 tokens of passages that share no run of 16 tokens with any source.

The truth is every maximal common span between a prompt and a source (brute force, from an index of
every 8-token window of the sources). "Found" is the share of the tokens of those spans that a
lookup covers, for spans of at least `--min-len` tokens. Two lookups:
- scan: SpanIndex.find, which looks the prompt up at every position (it finds every span of
  >= max_len + anchor_len - 1 tokens for certain);
- chunks: both sides cut into chunks, a span found when it holds a prompt chunk equal to the source's
  chunk at the same place (then extended to the whole span, as the scan does). It needs the two
  chunkings to fall onto common cut points inside the span ("resync": tokens from the span's start
  to the first place both cut).

Run: python bench/chunking.py   (about a minute on one core; writes bench/results/chunking.md)
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import platform
import random
import re
import statistics
import time
import tracemalloc
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

from kvsplice.bench.results import cpu_name, load_average
from kvsplice.loader.gguf import convert_gguf, default_model_path
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.reuse.chunking import ChunkSizes, chunk_ends
from kvsplice.reuse.span_index import SpanIndex

ROOT = Path(__file__).resolve().parent.parent
MUSIQUE = ROOT.parent / "shared" / "data" / "musique_s.json"
SYNTHETIC = ROOT / "kvsplice" / "data" / "synthetic_corpus.json"
RESULT = ROOT / "bench" / "results" / "chunking.md"
# The truth's window: common spans shorter than this are not seen (every min_len here is longer).
TRUTH_GRAM = 8
# A 4K-token prefill of the default model on one core of this machine, as the brief of issue 12 says.
PREFILL_4K_S = 6.0
PROMPT_TOKENS = 4096

INTROS = (
    "Answer the question using only the passages below.",
    "You are a helpful assistant. Read the documents and answer briefly.",
    "Use the retrieved context to answer. If it is not there, say so.",
    "Here are some search results. Answer the user's question from them.",
)
HEADERS: tuple[Callable[[int, str], str], ...] = (
    lambda i, title: f"Passage {i}: {title}\n",
    lambda i, title: f"Document [{i}] (Title: {title})\n",
    lambda i, title: f"## Source {i}\n",
    lambda i, title: f"[{i}] ",
)
SIZE_GRID = (
    ChunkSizes(8, 16, 32, 2),
    ChunkSizes(8, 16, 48, 0),
    ChunkSizes(8, 16, 48, 1),
    ChunkSizes(8, 16, 48, 2),
    ChunkSizes(8, 32, 48, 0),
    ChunkSizes(16, 32, 48, 0),
    ChunkSizes(16, 32, 48, 2),
    ChunkSizes(16, 32, 64, 2),
    ChunkSizes(32, 64, 128, 2),
)
ANCHOR_LENS = (4, 8, 16, 24)


@dataclass(frozen=True)
class Passage:
    title: str
    text: str


@dataclass(frozen=True)
class Workload:
    sources: list[list[int]]
    rag: list[list[int]]
    quotes: list[list[int]]
    fresh: list[list[int]]


class Run(NamedTuple):
    """A maximal common span: prompt tokens [start, end) equal the source's from source_start."""

    start: int
    end: int
    source: int
    source_start: int

    @property
    def length(self) -> int:
        return self.end - self.start


class Truth:
    """Every TRUTH_GRAM-token window of the sources, to find all maximal common spans by brute force."""

    def __init__(self, sources: list[list[int]]) -> None:
        self.sources = sources
        self.grams: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for s, tokens in enumerate(sources):
            for a in range(len(tokens) - TRUTH_GRAM + 1):
                self.grams.setdefault(tuple(tokens[a : a + TRUTH_GRAM]), []).append((s, a))

    def runs(self, prompt: list[int]) -> list[Run]:
        reach: dict[tuple[int, int], int] = {}  # (source, diagonal) -> end of the last run found on it
        runs = []
        for i in range(len(prompt) - TRUTH_GRAM + 1):
            for s, a in self.grams.get(tuple(prompt[i : i + TRUTH_GRAM]), ()):
                if reach.get((s, a - i), -1) > i:
                    continue
                src = self.sources[s]
                back = 0
                while i - back > 0 and a - back > 0 and prompt[i - back - 1] == src[a - back - 1]:
                    back += 1
                end = i + TRUTH_GRAM
                while end < len(prompt) and end + a - i < len(src) and prompt[end] == src[end + a - i]:
                    end += 1
                reach[(s, a - i)] = end
                runs.append(Run(i - back, end, s, a - back))
        return runs


# -- the workload ----------------------------------------------------------------------------------


def load_text() -> tuple[list[Passage], list[Passage], list[str]]:
    """Unique MuSiQue passages, the synthetic corpus's documents, MuSiQue's questions."""
    musique = json.loads(MUSIQUE.read_text(encoding="utf-8"))
    synthetic = json.loads(SYNTHETIC.read_text(encoding="utf-8"))
    texts = dict.fromkeys(c["text"] for q in musique for c in q["ctxs"])
    # MuSiQue's titles are empty: a passage's first words stand in for one.
    real = [Passage(" ".join(text.split()[:3]).title(), text) for text in texts]
    return real, [Passage(d["title"], d["text"]) for d in synthetic], [q["question"] for q in musique]


def chat(tokenizer: Tokenizer, user: str) -> list[int]:
    assert tokenizer.bos_token_id is not None
    text = f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
    return [tokenizer.bos_token_id, *tokenizer.encode(text)]


def rag_prompt(rng: random.Random, passages: Sequence[Passage], question: str) -> str:
    header = rng.choice(HEADERS)
    body = "".join(f"{header(i + 1, p.title)}{p.text}\n\n" for i, p in enumerate(passages))
    return f"{rng.choice(INTROS)}\n\n{body}Question: {question}"


def build_workload(tokenizer: Tokenizer, num_sources: int, num_prompts: int, seed: int) -> Workload:
    rng = random.Random(seed)
    real, synthetic, questions = load_text()
    passages = real + synthetic
    rng.shuffle(passages)
    carried, unseen = passages[: num_sources * 3], passages[num_sources * 3 :]
    sources, used = [], []
    for _ in range(num_sources):
        picked = rng.sample(carried, 6)
        used.extend(picked)
        sources.append(chat(tokenizer, rag_prompt(rng, picked, rng.choice(questions))))
    rag = []
    for _ in range(num_prompts):
        picked = rng.sample(used, 4) + rng.sample(unseen, 2)
        rng.shuffle(picked)
        rag.append(chat(tokenizer, rag_prompt(rng, picked, rng.choice(questions))))
    quotes = []
    for _ in range(num_prompts):
        claims = []
        for passage in rng.sample(used, 6):
            sentences = [s for s in re.split(r"(?<=\.) ", passage.text) if len(s) > 40] or [passage.text]
            new = rng.choice(unseen).text[: rng.randrange(100, 600)]
            claims.append(f'{new}\n\nIs this claim supported: "{rng.choice(sentences)}"')
        quotes.append(chat(tokenizer, "\n\n".join(claims)))
    # MuSiQue's passages overlap (windows of one article): keep only those sharing nothing with sources.
    truth = Truth(sources)
    encoded = (tokenizer.encode(p.text + "\n\n") for p in unseen)
    novel = [ids for ids in encoded if all(r.length < 16 for r in truth.runs(ids))]
    fresh = []
    for _ in range(num_prompts):
        ids: list[int] = []
        while len(ids) < PROMPT_TOKENS:
            ids += rng.choice(novel)
        fresh.append(ids[:PROMPT_TOKENS])
    return Workload(sources, rag, quotes, fresh)


# -- lookups and measurements ----------------------------------------------------------------------


def coverage(runs_per_prompt: list[list[Run]], covered: list[set[int]], lo: int, hi: int) -> float:
    """% of the tokens of common spans with lo <= length < hi that are covered."""
    shared = found = 0
    for runs, cov in zip(runs_per_prompt, covered, strict=True):
        tokens = {t for r in runs if lo <= r.length < hi for t in range(r.start, r.end)}
        shared += len(tokens)
        found += len(tokens & cov)
    return 100.0 * found / shared if shared else float("nan")


def uncovered_stretches(runs_per_prompt: list[list[Run]], covered: list[set[int]]) -> list[int]:
    """Lengths of the maximal stretches of common spans' tokens that nothing covers."""
    stretches = []
    for runs, cov in zip(runs_per_prompt, covered, strict=True):
        tokens = sorted({t for r in runs for t in range(r.start, r.end)} - cov)
        for _, group in itertools.groupby(enumerate(tokens), key=lambda item: item[1] - item[0]):
            stretches.append(len(list(group)))
    return stretches


def build_index(sizes: ChunkSizes, anchor_len: int, sources: list[list[int]]) -> SpanIndex:
    index = SpanIndex(sizes, anchor_len)
    for s, tokens in enumerate(sources):
        index.add("bench", s, tokens)
    return index


def find_all(index: SpanIndex, prompts: list[list[int]], min_len: int) -> None:
    for prompt in prompts:
        index.find("bench", prompt, min_len)


def scan_covered(index: SpanIndex, prompt: list[int], min_len: int) -> set[int]:
    return {t for m in index.find("bench", prompt, min_len) for t in range(m.start, m.end)}


def chunk_covered(
    sizes: ChunkSizes, source_bounds: list[list[int]], prompt: list[int], runs: list[Run]
) -> tuple[set[int], list[int | None]]:
    """Tokens of the runs that hold a prompt chunk equal to the source's chunk at the same place; and
    per run, where from its start both chunkings first cut at the same place (None: nowhere).
    source_bounds: each source's chunk boundaries, 0 and every chunk end."""
    bounds = [0, *chunk_ends(prompt, sizes)]
    covered: set[int] = set()
    resync: list[int | None] = []
    for run in runs:
        shift = run.source_start - run.start
        theirs = source_bounds[run.source]
        ours = [b for b in bounds if run.start <= b <= run.end]
        common = [b for b in ours if theirs[bisect_right(theirs, b + shift) - 1] == b + shift]
        resync.append(common[0] - run.start if common else None)
        # A chunk matches: consecutive boundaries of the prompt, consecutive in the source too.
        for p, q in itertools.pairwise(ours):
            j = bisect_right(theirs, p + shift) - 1
            if theirs[j] == p + shift and j + 1 < len(theirs) and theirs[j + 1] == q + shift:
                covered.update(range(run.start, run.end))
                break
    return covered, resync


def timed_ms(fn: Callable[[], object], repeats: int, per: int) -> tuple[float, float]:
    """Fastest and median of `repeats` calls, in ms per item (`per` items a call), GC paused."""
    times = []
    gc.disable()
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t) / per)
    finally:
        gc.enable()
    return min(times), statistics.median(times)


def index_bytes_per_token(sizes: ChunkSizes, anchor_len: int, sources: list[list[int]]) -> float:
    """What the index holds per indexed token, measured with tracemalloc."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = build_index(sizes, anchor_len, sources)
    total = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return total / index.num_tokens


def chunk_stats(sizes: ChunkSizes, sequences: list[list[int]]) -> tuple[float, float]:
    """Mean chunk length, and % of chunks cut at max_len (sequences' last chunks left out)."""
    lengths = []
    for tokens in sequences:
        ends = chunk_ends(tokens, sizes)
        lengths += [e - s for s, e in itertools.pairwise([0, *ends])][:-1]
    return statistics.mean(lengths), 100.0 * sum(n == sizes.max_len for n in lengths) / len(lengths)


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


# -- the report's sections -------------------------------------------------------------------------


def sizes_section(work: Workload, truth: dict[str, list[list[Run]]], min_len: int) -> list[str]:
    lines = [
        "## Chunk sizes",
        "",
        f"Found: % of the tokens of common spans of >= {min_len} tokens covered (quotes {min_len}-"
        f"{2 * min_len - 1}: spans of that length only). Resync: tokens from the start of a common span "
        "to the first place both chunkings cut, median / 90th percentile / % of spans where they never "
        "do. Guaranteed: the span length the scan always finds, with 16-token anchors. Memory: the "
        "index's bytes per indexed token (tracemalloc).",
        "",
        row(
            "min / avg / max",
            "norm.",
            "mean chunk",
            "cut at max",
            "resync",
            "guaranteed",
            "scan: rag",
            "scan: quotes",
            "chunks: rag",
            "chunks: quotes",
            f"chunks: quotes {min_len}-{2 * min_len - 1}",
            "memory B/token",
        ),
        row("---", *["---:"] * 3, "---", *["---:"] * 7),
    ]
    everything = work.sources + work.rag + work.quotes + work.fresh
    for sizes in SIZE_GRID:
        mean, forced = chunk_stats(sizes, everything)
        index = build_index(sizes, 16, work.sources)
        source_bounds = [[0, *chunk_ends(t, sizes)] for t in work.sources]
        found: dict[str, float] = {}
        resyncs: list[int | None] = []
        for name, prompts in (("rag", work.rag), ("quotes", work.quotes)):
            runs = [[r for r in rs if r.length >= min_len] for rs in truth[name]]
            scan = [scan_covered(index, p, min_len) for p in prompts]
            chunked = []
            for prompt, prompt_runs in zip(prompts, runs, strict=True):
                covered, resync = chunk_covered(sizes, source_bounds, prompt, prompt_runs)
                chunked.append(covered)
                resyncs += resync
            found[f"scan {name}"] = coverage(runs, scan, min_len, 1 << 30)
            found[f"chunks {name}"] = coverage(runs, chunked, min_len, 1 << 30)
            found[f"chunks {name} short"] = coverage(runs, chunked, min_len, 2 * min_len)
        synced = sorted(r for r in resyncs if r is not None)
        never = 100.0 * (len(resyncs) - len(synced)) / len(resyncs)
        lines.append(
            row(
                f"{sizes.min_len} / {sizes.avg_len} / {sizes.max_len}",
                sizes.normalization,
                f"{mean:.1f}",
                f"{forced:.0f}%",
                f"{statistics.median(synced):.0f} / {synced[int(0.9 * len(synced))]} / {never:.1f}%",
                sizes.max_len + 15,
                f"{found['scan rag']:.1f}%",
                f"{found['scan quotes']:.1f}%",
                f"{found['chunks rag']:.1f}%",
                f"{found['chunks quotes']:.1f}%",
                f"{found['chunks quotes short']:.1f}%",
                f"{index_bytes_per_token(sizes, 16, work.sources):.1f}",
            )
        )
        print(lines[-1], flush=True)
    return lines


def anchors_section(
    work: Workload, truth: dict[str, list[list[Run]]], min_len: int, repeats: int
) -> list[str]:
    sizes = ChunkSizes()
    short = min_len // 2
    lines = [
        f"## Anchor length (chunk sizes {sizes.min_len} / {sizes.avg_len} / {sizes.max_len})",
        "",
        "Chance matches: spans `find(min_len=1)` returns per fresh 4K-token prompt (fresh prompts share "
        "no run of 16 tokens with any source): short runs an anchor happened to hold, each verified and "
        f"extended for nothing. find: ms per fresh 4K-token prompt at min_len {min_len}, fastest / median. "
        f"Quotes {short}-{min_len - 1}: % of the tokens of those shorter spans found at min_len {short} "
        "(below the guarantee, so by chance).",
        "",
        row(
            "anchor_len",
            "guaranteed",
            "chance matches",
            "longest",
            "find ms",
            f"quotes {short}-{min_len - 1}",
        ),
        row(*["---:"] * 6),
    ]
    runs = [[r for r in rs if r.length >= short] for rs in truth["quotes"]]
    for anchor_len in ANCHOR_LENS:
        index = build_index(sizes, anchor_len, work.sources)
        chance = [index.find("bench", p, 1) for p in work.fresh]
        fast, median = timed_ms(partial(find_all, index, work.fresh, min_len), repeats, len(work.fresh))
        quotes = coverage(runs, [scan_covered(index, p, short) for p in work.quotes], short, min_len)
        lines.append(
            row(
                anchor_len,
                sizes.max_len + anchor_len - 1,
                f"{statistics.mean(map(len, chance)):.2f}",
                max((m.length for ms in chance for m in ms), default=0),
                f"{fast:.2f} / {median:.2f}",
                f"{quotes:.1f}%",
            )
        )
        print(lines[-1], flush=True)
    return lines


def cost_section(work: Workload, truth: dict[str, list[list[Run]]], min_len: int, repeats: int) -> list[str]:
    sizes = ChunkSizes()
    index = build_index(sizes, 16, work.sources)
    fresh, rag = work.fresh, [p[:PROMPT_TOKENS] for p in work.rag]
    runs = [[r for r in rs if r.length >= min_len] for rs in truth["rag"] + truth["quotes"]]
    # How many anchors one prompt position meets: find checks the newest max_hits of them.
    anchor_grams: dict[tuple[int, ...], int] = {}
    for tokens in work.sources:
        for a in [0, *chunk_ends(tokens, sizes)[:-1]]:
            gram = tuple(tokens[a : a + 16])
            anchor_grams[gram] = anchor_grams.get(gram, 0) + 1
    most_hits = max(
        anchor_grams.get(tuple(p[i : i + 16]), 0)
        for p in work.rag + work.quotes + fresh
        for i in range(len(p))
    )
    left = uncovered_stretches(runs, [scan_covered(index, p, min_len) for p in work.rag + work.quotes])
    shared = sum(len({t for r in rs for t in range(r.start, r.end)}) for rs in runs)

    def add_remove() -> None:
        for i, prompt in enumerate(fresh):
            index.add("bench", ("fresh", i), prompt)
        for i in range(len(fresh)):
            index.remove(("fresh", i))

    timings = [
        (
            "chunk_ends (the chunking inside add)",
            timed_ms(lambda: [chunk_ends(p, sizes) for p in fresh], repeats, len(fresh)),
        ),
        (
            "find, fresh prompt",
            timed_ms(lambda: [index.find("bench", p, min_len) for p in fresh], repeats, len(fresh)),
        ),
        (
            "find, rag prompt (first 4,096 tokens)",
            timed_ms(lambda: [index.find("bench", p, min_len) for p in rag], repeats, len(rag)),
        ),
        ("add + remove, fresh prompt", timed_ms(add_remove, repeats, len(fresh))),
    ]
    total = timings[1][1][0] + timings[3][1][0]
    memory = index_bytes_per_token(sizes, 16, work.sources)
    lines = [
        f"## Cost and size of the defaults ({sizes.min_len} / {sizes.avg_len} / {sizes.max_len}, "
        "16-token anchors)",
        "",
        f"ms per 4,096-token prompt, fastest / median of {repeats} runs over {len(fresh)} prompts; the "
        f"index holds {index.num_tokens:,} tokens in {len(index)} sources.",
        "",
        row("operation", "ms (fastest)", "ms (median)"),
        row("---", "---:", "---:"),
        *(row(name, f"{fast:.2f}", f"{median:.2f}") for name, (fast, median) in timings),
        "",
        f"find + add (+ remove, on eviction) of a 4K-token prompt: {total:.1f} ms, "
        f"{100 * total / (1e3 * PREFILL_4K_S):.2f}% of a 4K-token prefill on one core "
        f"(~{PREFILL_4K_S:.0f} s).",
        "",
        f"What the scan leaves of the common spans of >= {min_len} tokens in the rag and quote prompts: "
        f"{sum(left)} of {shared:,} tokens, in {len(left)} stretches of at "
        f"most {max(left, default=0)} tokens: where a longer span of another source overlaps a span, and "
        f"what remains of it is shorter than min_len ({min_len}). The most anchors one prompt position "
        f"met: {most_hits} (find checks at most max_hits = {index.max_hits}, the newest).",
        "",
        f"Memory: {memory:.1f} bytes per indexed token: 4 for the copy of the tokens (int32), the rest for "
        f"the anchors, one per {index.num_tokens / index.num_anchors:.1f} tokens. The KV it points to takes "
        "~36,864 bytes per token (Gemma 3 270M, float32).",
    ]
    print("\n".join(lines), flush=True)
    return lines


def chance_section(tokenizer: Tokenizer, seed: int) -> list[str]:
    """How long a common run gets between texts that share no passage: fictional towns and people (the
    synthetic corpus) against Wikipedia (MuSiQue)."""
    real, synthetic, _ = load_text()
    rng = random.Random(seed)
    left = [tokenizer.encode(p.text) for p in rng.sample(real, 300)]
    right = [tokenizer.encode(p.text) for p in synthetic]
    truth = Truth(left)
    lengths = sorted(r.length for prompt in right for r in truth.runs(prompt))
    lines = [
        "## Chance repeats",
        "",
        f"Maximal common runs of >= {TRUTH_GRAM} tokens between the synthetic corpus ({len(right)} "
        f"documents, {sum(map(len, right)):,} tokens) and 300 MuSiQue passages ({sum(map(len, left)):,} "
        f"tokens), which share no text: {len(lengths)} runs; longest {lengths[-1] if lengths else 0}; "
        f"{sum(n >= 16 for n in lengths)} of >= 16 tokens.",
    ]
    print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    started, load_start = time.time(), load_average()
    tokenizer = Tokenizer.from_dir(convert_gguf(default_model_path()))
    work = build_workload(tokenizer, args.sources, args.prompts, args.seed)
    oracle = Truth(work.sources)
    truth = {
        name: [oracle.runs(p) for p in prompts]
        for name, prompts in (("rag", work.rag), ("quotes", work.quotes))
    }
    shared = {name: sum(r.length >= args.min_len for rs in runs for r in rs) for name, runs in truth.items()}
    print(f"workload and truth in {time.time() - started:.0f} s", flush=True)
    body = [
        *sizes_section(work, truth, args.min_len),
        "",
        *anchors_section(work, truth, args.min_len, args.repeats),
        "",
        *cost_section(work, truth, args.min_len, args.repeats),
        "",
        *chance_section(tokenizer, args.seed),
    ]
    header = [
        "# Content-defined chunking and the span index on real text",
        "",
        f"Machine: {cpu_name()}; {platform.python_implementation()} {platform.python_version()}, one "
        f"thread; load average {load_start} at the start, {load_average()} at the end; "
        f"{platform.platform()}.",
        "",
        f"Produced by `python bench/chunking.py` (seed {args.seed}, {time.time() - started:.0f} s): "
        f"{len(work.sources)} sources ({sum(map(len, work.sources)):,} tokens) and {args.prompts} prompts of "
        f"each kind, in tokens of the Gemma 3 tokenizer; common spans of >= {args.min_len} tokens: "
        f"{shared['rag']} in the rag prompts, {shared['quotes']} in the quote prompts. The script's "
        "docstring describes the workloads and the two lookups.",
        "",
    ]
    args.out.write_text("\n".join(header + body) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
