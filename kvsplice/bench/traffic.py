"""`kvsplice bench traffic`: what each system costs under sustained load, background work included.

Three real `kvsplice serve` processes, one per system:
    splice   `--prefix-cache radix`, auto_segments on (kvsplice's defaults: spans found without markup)
    radix    `--prefix-cache radix --no-auto-segments` (what SGLang would reuse)
    hash     `--prefix-cache hash --no-auto-segments` (vLLM's prefix cache)
are sent plain RAG chat messages (traffic_workload.py: k passages drawn with Zipf popularity, a
question) with the `openai` client, streamed, open-loop: each request leaves at its Poisson arrival
time whether or not earlier ones have answered. Per mix, rates go from light load to past saturation
(RATE_MULTIPLIERS x the requests/s one idle server sustains, measured first). The three servers are
up at once but only one runs a cell at a time, all three on the same arrival times, in an order
rotated per rate: run one after another, the systems met different loads on a shared 2-core
machine; an idle server costs nothing. Each mix and rate has a cache salt of
its own, so no cell reuses another's KV. Compute and reuse are the server's own /metrics counters,
read before and after each cell once the server is idle (background work done).

Why not guidellm or inference-perf: inference-perf needs Python >= 3.12 (the project runs 3.11).
guidellm installs without torch (34 pure-Python packages: datasets, pandas, pyarrow, sanic, ...) and
has Poisson rates and file datasets, but it drives one server per run from worker processes of its
own (on 2 cores they compete with the servers measured, and three systems could not take turns on
the same load), counts tokens with a Hugging Face tokenizer it fetches from the hub, and knows
nothing of /metrics: the per-cell counters and salts would be wrapped around it anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from kvsplice.bench import corpus as corpora
from kvsplice.bench.results import MachineInfo, load_average
from kvsplice.bench.server_process import serve
from kvsplice.bench.traffic_report import (
    Calibration,
    Cell,
    Compute,
    MixInfo,
    Sent,
    TrafficResult,
    agreement,
    is_idle,
    parse_metrics,
    write,
)
from kvsplice.bench.traffic_workload import (
    Mix,
    TrafficRequest,
    build_requests,
    first_seen_share,
    parse_mixes,
    poisson_schedule,
)
from kvsplice.config import NESTED, EngineConfig

SYSTEMS = {
    "splice": ("--prefix-cache", "radix", "--auto-segments"),
    "radix": ("--prefix-cache", "radix", "--no-auto-segments"),
    "hash": ("--prefix-cache", "hash", "--no-auto-segments"),
}
# Light load to past saturation, as multiples of one idle server's requests/s.
RATE_MULTIPLIERS = (0.25, 0.5, 1.0, 2.0)
# The TTFT SLO, as a multiple of the radix system's idle TTFT on new passages.
SLO_FACTOR = 3.0
CALIBRATION_REQUESTS = 3
FIDELITY_SAMPLES = 3
IDLE_TIMEOUT_S = 600.0
DEFAULT_OUT = Path("bench/results/traffic")
# Engine fields each system sets, and the KV pool, which the bench splits among the servers.
SET_PER_SERVER = frozenset({"prefix_cache", "auto_segments", "kv_cache_gb"})


@dataclass(frozen=True)
class TrafficConfig:
    mixes: tuple[str, ...] = ("popular", "novel")
    # Requests/s; empty: RATE_MULTIPLIERS x the capacity measured at the start.
    rates: tuple[float, ...] = ()
    requests: int = 12
    docs: int = 4
    doc_words: int = 100
    max_tokens: int = 8
    seed: int = 0
    source: str = "auto"
    # Passages marked as segments in the messages (else plain strings, found by auto_segments).
    marked: bool = False
    # Flags every server gets (model, threads, KV pool), before its system's own.
    server_flags: tuple[str, ...] = ()
    command: str = ""

    def __post_init__(self) -> None:
        parse_mixes(list(self.mixes))
        if min(self.requests, self.docs, self.doc_words, self.max_tokens) < 1:
            raise ValueError("requests, docs, doc_words and max_tokens must be >= 1")
        if any(rate <= 0 for rate in self.rates):
            raise ValueError(f"rates must be > 0 requests/s, got {' '.join(map(str, self.rates))}")


def server_flags(engine: EngineConfig, kv_cache_gb: float) -> list[str]:
    """`kvsplice serve` flags for the engine options set away from their defaults, and the KV pool;
    the systems set the prefix cache and auto_segments. Raises ValueError for tiers or KV events:
    three servers sharing one store would not be three systems."""
    flags = ["--kv-cache-gb", f"{kv_cache_gb:g}"]
    for f in dataclasses.fields(EngineConfig):
        value = getattr(engine, f.name)
        if f.name in SET_PER_SERVER or value == f.default:
            continue
        if f.name in NESTED:
            raise ValueError("bench traffic runs its servers without store tiers or KV events")
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, str(value)]
    return flags


def rotated(systems: list[str], turn: int) -> list[str]:
    """The systems in the order they go on this turn: each goes first as often as the others."""
    k = turn % len(systems)
    return systems[k:] + systems[:k]


def fidelity_sample(n: int, rng: random.Random) -> list[int]:
    """Requests of a cell's second half, where passages have recurred: the ones checked for fidelity."""
    later = range(n // 2, n)
    return sorted(rng.sample(later, min(FIDELITY_SAMPLES, len(later))))


@dataclass(frozen=True)
class Endpoint:
    """Where a system answers (one server, or a router in front of replicas) and the /metrics its work
    is counted from (every replica's, summed)."""

    url: str
    metrics_urls: tuple[str, ...]


@dataclass
class _Server:
    url: str
    client: openai.AsyncOpenAI
    model: str
    http: httpx.AsyncClient
    metrics_urls: tuple[str, ...]

    async def idle_metrics(self) -> dict[str, float]:
        """/metrics, summed over the replicas, once nothing runs, waits or is queued as background work."""
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while True:
            samples: dict[str, float] = {}
            for url in self.metrics_urls:
                for name, value in parse_metrics((await self.http.get(f"{url}/metrics")).text).items():
                    samples[name] = samples.get(name, 0.0) + value
            if is_idle(samples):
                return samples
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.url} not idle after {IDLE_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.2)


async def send(
    server: _Server, request: TrafficRequest, salt: str, max_tokens: int, index: int = 0,
    scheduled_s: float = 0.0, start: float | None = None,
) -> Sent:  # fmt: skip
    """One streamed chat request; times count from its scheduled send time (start + scheduled_s)."""
    t0 = (time.perf_counter() if start is None else start) + scheduled_s
    sent = Sent(index, scheduled_s, late_s=time.perf_counter() - t0)
    try:
        stream = await server.client.chat.completions.create(
            model=server.model, messages=list(request.messages), max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True},
            extra_body={"cache_salt": salt, "ignore_eos": True, "return_token_ids": True},
        )  # type: ignore[call-overload]  # fmt: skip
        async for chunk in stream:
            if chunk.choices:
                choice = chunk.choices[0]
                # The first chunk carries the role before any token is computed: wait for content.
                if sent.ttft_s is None and (choice.delta.content or choice.finish_reason):
                    sent.ttft_s = time.perf_counter() - t0
                if getattr(choice, "token_ids", None) is not None:
                    sent.token_ids = list(choice.token_ids)  # type: ignore[attr-defined]
            if chunk.usage is not None:
                sent.prompt_tokens = chunk.usage.prompt_tokens
                sent.completion_tokens = chunk.usage.completion_tokens
    except openai.APIError as err:
        sent.error = f"{type(err).__name__}: {err}"[:300]
    sent.e2e_s = time.perf_counter() - t0
    return sent


async def run_cell(
    server: _Server, system: str, mix: str, rate: float, load: float | None,
    requests: list[TrafficRequest], schedule: list[float], salt: str, max_tokens: int,
) -> Cell:  # fmt: skip
    """Send `requests` open-loop at `schedule`; compute from /metrics, idle before and after."""
    before = await server.idle_metrics()
    start = time.perf_counter()

    async def fire(i: int) -> Sent:
        await asyncio.sleep(max(0.0, start + schedule[i] - time.perf_counter()))
        return await send(server, requests[i], salt, max_tokens, i, schedule[i], start)

    sent = await asyncio.gather(*(fire(i) for i in range(len(requests))))
    wall_s = max(s.scheduled_s + (s.e2e_s or 0.0) for s in sent)
    after = await server.idle_metrics()
    return Cell(system, mix, rate, load, wall_s, list(sent), Compute.delta(before, after))


async def calibrate(
    servers: dict[str, _Server], prompts: list[TrafficRequest], max_tokens: int, baseline: str
) -> Calibration:
    """Idle requests of new passages, each under a salt of its own, the systems taking turns; the first
    per server is a warm-up (the first request after start pays one-time costs). Capacity and SLO are
    the `baseline` system's."""
    ttft: dict[str, list[float]] = {name: [] for name in servers}
    e2e: dict[str, list[float]] = {name: [] for name in servers}
    tokens = []
    for i, prompt in enumerate(prompts):
        for name in rotated(list(servers), i):
            await servers[name].idle_metrics()
            s = await send(servers[name], prompt, f"calibrate-{i}", max_tokens)
            if s.error is not None or s.ttft_s is None or s.e2e_s is None:
                raise RuntimeError(f"calibration request to {name} failed: {s.error}")
            if i > 0:
                ttft[name].append(s.ttft_s)
                e2e[name].append(s.e2e_s)
                tokens.append(s.prompt_tokens)
    ttft_s = {name: statistics.median(v) for name, v in ttft.items()}
    e2e_s = {name: statistics.median(v) for name, v in e2e.items()}
    return Calibration(
        prompt_tokens=statistics.mean(tokens),
        ttft_s=ttft_s,
        e2e_s=e2e_s,
        capacity_per_s=1.0 / e2e_s[baseline],
        slo_factor=SLO_FACTOR,
        slo_s=SLO_FACTOR * ttft_s[baseline],
    )


async def _drive(
    endpoints: dict[str, Endpoint], config: TrafficConfig, workloads: dict[str, list[TrafficRequest]],
    calibration_prompts: list[TrafficRequest], baseline: str, reference: str,
) -> tuple[Calibration, list[Cell]]:  # fmt: skip
    servers = {}
    for name, end in endpoints.items():
        client = openai.AsyncOpenAI(base_url=f"{end.url}/v1", api_key="none", max_retries=0, timeout=3600)
        model = (await client.models.list()).data[0].id
        servers[name] = _Server(end.url, client, model, httpx.AsyncClient(timeout=60), end.metrics_urls)
    calibration = await calibrate(servers, calibration_prompts, config.max_tokens, baseline)
    loads: tuple[float | None, ...] = (None,) * len(config.rates) if config.rates else RATE_MULTIPLIERS
    rates = config.rates or tuple(m * calibration.capacity_per_s for m in RATE_MULTIPLIERS)
    _progress(f"calibrated: capacity {calibration.capacity_per_s:.3f} requests/s, SLO TTFT "
              f"<= {calibration.slo_s:.2f} s; rates {', '.join(f'{r:.3f}' for r in rates)}")  # fmt: skip
    cells: list[Cell] = []
    turn = 0
    for mix, requests in workloads.items():
        for i, (rate, load) in enumerate(zip(rates, loads, strict=True)):
            rng = random.Random(f"{config.seed}-{mix}-{i}")
            schedule = poisson_schedule(rate, len(requests), rng)
            salt = f"{mix}-{i}"
            group = []
            for system in rotated(list(servers), turn):
                cell = await run_cell(servers[system], system, mix, rate, load, requests, schedule, salt,
                                      config.max_tokens)  # fmt: skip
                group.append(cell)
                _progress(f"{mix} {rate:.3f} req/s {system}: {len(requests)} requests in {cell.wall_s:.0f} s")
            turn += 1
            # A full prefill of each sampled prompt: the reference system under a salt nothing else used.
            expected = {}
            for index in fidelity_sample(len(requests), rng):
                ref = await send(
                    servers[reference], requests[index], f"{salt}-reference-{index}", config.max_tokens
                )
                if ref.error is None:
                    expected[index] = ref.token_ids
            for cell in group:
                cell.agreement = agreement(expected, cell.sent)
            cells += group
    for server in servers.values():
        await server.http.aclose()
        await server.client.close()
    return calibration, cells


def run_traffic(config: TrafficConfig) -> TrafficResult:
    """Start the three servers, calibrate, run every mix at every rate on every system."""

    def start(stack: contextlib.ExitStack) -> dict[str, Endpoint]:
        urls = {
            name: stack.enter_context(serve([*config.server_flags, *flags]))
            for name, flags in SYSTEMS.items()
        }
        return {name: Endpoint(url, (url,)) for name, url in urls.items()}

    return measure(config, start, baseline="radix", reference="hash")


def measure(
    config: TrafficConfig, start: Callable[[contextlib.ExitStack], dict[str, Endpoint]], baseline: str,
    reference: str,
) -> TrafficResult:  # fmt: skip
    """Build the workloads, start the systems (`start` enters them into the stack, which stops them),
    calibrate on `baseline`, run every mix at every rate on every system, and sample fidelity against a
    full prefill on `reference` (under a fresh salt)."""
    mixes = parse_mixes(list(config.mixes))
    source = corpora.load(config.source)
    workloads = {
        mix.name: build_requests(
            mix, config.requests, config.docs, config.doc_words, config.seed, source, config.marked
        )
        for mix in mixes
    }
    # New passages for every calibration request: a pool as large as the corpus, drawn flat.
    everything = Mix("calibration", len(source.passages), 0.0, "")
    prompts = build_requests(everything, CALIBRATION_REQUESTS + 1, config.docs, config.doc_words,
                             config.seed, source, config.marked)  # fmt: skip
    machine = MachineInfo.collect()
    started, t0 = time.strftime("%Y-%m-%d %H:%M:%S"), time.perf_counter()
    with contextlib.ExitStack() as stack:
        endpoints = start(stack)
        calibration, cells = asyncio.run(_drive(endpoints, config, workloads, prompts, baseline, reference))
    notes = _notes(cells, source.name)
    return TrafficResult(
        command=config.command,
        machine=dataclasses.replace(machine, load_end=load_average()),
        config=dataclasses.asdict(config),
        calibration=calibration,
        mixes=[
            MixInfo(
                mix.name,
                mix.description,
                min(mix.pool, len(source.passages)),
                mix.zipf,
                first_seen_share(workloads[mix.name]),
                config.requests,
            )
            for mix in mixes
        ],
        cells=cells,
        notes=notes,
        started=started,
        wall_s=time.perf_counter() - t0,
    )


def _notes(cells: list[Cell], corpus_name: str) -> list[str]:
    notes = []
    if corpus_name != "musique":
        notes.append(f"passages from the {corpus_name} corpus ({corpora.MUSIQUE_FILE} not found)")
    late = max((s.late_s for c in cells for s in c.sent), default=0.0)
    if late > 0.1:
        notes.append(
            f"the client sent a request up to {late:.2f} s after its scheduled time (counted in TTFT)"
        )
    errors = {s.error for c in cells for s in c.sent if s.error}
    if errors:
        notes.append(f"failed requests: {'; '.join(sorted(errors))}")
    return notes


def _progress(message: str) -> None:
    print(f"[traffic] {message}", file=sys.stderr, flush=True)


def config_from_args(args: argparse.Namespace) -> TrafficConfig:
    """The run the bench CLI's arguments ask for; raises ValueError for arguments traffic cannot honour."""
    if args.systems or args.budgets or args.unmarked or args.pool or args.turns:
        raise ValueError("bench traffic runs splice, radix and hash; --systems, --budgets, --unmarked, "
                         "--pool and --turns are for the other workloads")  # fmt: skip
    docs = args.docs or [TrafficConfig.docs]
    if len(docs) != 1:
        raise ValueError("bench traffic takes one --docs count")
    return TrafficConfig(
        mixes=tuple(args.mixes or TrafficConfig.mixes),
        rates=tuple(args.rates or ()),
        requests=args.requests or TrafficConfig.requests,
        docs=docs[0],
        doc_words=args.doc_words or TrafficConfig.doc_words,
        seed=args.seed,
        source=args.source,
        marked=args.marked,
        server_flags=tuple(server_flags(EngineConfig.from_args(args), args.kv_cache_gb / len(SYSTEMS))),
        command=shlex.join(["kvsplice", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else "",
    )


def main(config: TrafficConfig, out: Path | None) -> None:
    """Run, print the report, write DIR/report.md and DIR/results.json (DIR: out or DEFAULT_OUT)."""
    result = run_traffic(config)
    out = out or DEFAULT_OUT
    print(write(result, out))
    print(f"[wrote {out / 'report.md'}, {out / 'results.json'}]", file=sys.stderr)
