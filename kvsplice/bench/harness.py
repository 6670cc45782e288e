"""Run a workload on every system, request by request, and measure.

Engines: one per prefix cache among off / hash / radix, and one shared by every splice system (each
with its own cache salt). All load the same weights once (the loader shares them) and own a KV pool.
Requests run one at a time, in workload order; for each request every system runs it, in an order
rotated by one system per request (round-robin), so machine noise and warm caches hit all systems
alike. Warm-up requests run on every system but the reference (which keeps no state) and are not
measured. Then each system's output is compared with the reference's (`off`, a full prefill).

Peak KV memory: KV blocks are counted after each engine step through the pool's allocator
(`num_used`: blocks with a holder, i.e. running requests, radix nodes, segment-store entries). A
system's *held* blocks are the sum of the changes in `num_used` over its requests (exact while
nothing is evicted: a shared engine runs one request at a time); its peak is the most it held plus
the most its running request added after any step (the request's blocks, reserved for prompt and
continuation at admission, and any segment-store fills). vLLM's hash cache keeps cached KV in free
blocks (reclaimed at no cost), so only its running request shows.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime

import torch
from tqdm import tqdm

from kvsplice.bench.base import BenchRequest, Workload, WorkloadSpec
from kvsplice.bench.metrics import RequestRecord, compare, is_correct, per_turn, summarize
from kvsplice.bench.results import BenchResult, MachineInfo, ModelInfo, load_average
from kvsplice.bench.systems import (
    DEFAULT_BUDGETS,
    REFERENCE,
    SPLICE_ENGINE,
    System,
    WordHashEncoder,
    default_systems,
    parse_systems,
    prompt_parts,
    unmarked,
)
from kvsplice.bench.workloads import make_workload
from kvsplice.cache.segments import canonical_context_length
from kvsplice.config import DTYPES, EngineConfig
from kvsplice.kv.pool import bytes_per_block
from kvsplice.llm import LLM
from kvsplice.loader.model_files import resolve_model_dir
from kvsplice.loader.tokenizer import Tokenizer
from kvsplice.model_config import ModelConfig
from kvsplice.options import RequestOptions
from kvsplice.reuse import segment_kv
from kvsplice.sampling import SamplingParams

GIB = 2**30


@dataclass(frozen=True)
class BenchConfig:
    workload: str
    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    # System names (see systems.py); empty: the workload's default set.
    systems: tuple[str, ...] = ()
    # Budgets (percent) for systems named without one; None: the workload's default.
    budgets: tuple[float, ...] | None = None
    # Also send every request unmarked to a twin of each splice system (systems.unmarked).
    unmarked: bool = False
    # Send only the measured requests: the shared content is new to every pool, so with a store tier
    # (--store-dir, --store-url) filled by an earlier run it comes from there, as after a restart.
    skip_warmup: bool = False
    # Greedy continuation length compared with the reference's.
    continuation: int = 16
    # Every engine's options (model, threads, dtypes, store, ...); the bench sets, per engine, its
    # prefix cache, auto_segments, its pool size and max_num_seqs=1 (bench/cli.py: SET_PER_ENGINE).
    engine: EngineConfig = field(default_factory=EngineConfig)
    # All KV pools together at most (each is sized to what the workload can ever write).
    kv_cache_gb: float = 8.0
    progress: bool = True
    # How the run was started, for the report.
    command: str = ""


@dataclass
class _Engine:
    llm: LLM | None
    error: str | None = None


class _Run:
    def __init__(self, config: BenchConfig, workload: Workload, systems: list[System]) -> None:
        self.config = config
        self.workload = workload
        self.systems = systems
        self.notes: list[str] = []
        self.model_dir = resolve_model_dir(config.engine.model)
        self.model_cfg = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = (
            Tokenizer.from_dir(self.model_dir) if (self.model_dir / "tokenizer.json").exists() else None
        )
        self.encode = None if self.tokenizer else WordHashEncoder(self.model_cfg.vocab_size)
        self.block_bytes = bytes_per_block(
            self.model_cfg, config.engine.block_size, DTYPES[config.engine.kv_dtype]
        )
        self.pools = self._size_pools()
        self.engines = {key: self._engine(key, gib) for key, gib in self.pools.items()}
        self.params = SamplingParams(
            max_tokens=config.continuation, temperature=0.0, return_first_logits=True
        )
        # Blocks held by each system's caches (see the module docstring).
        self.held: dict[str, int] = defaultdict(int)
        # Radix-tree evictions seen per engine (the tree shrank while a request was admitted).
        self.evictions: dict[str, int] = defaultdict(int)

    # -- setup ----------------------------------------------------------------------------------

    def _num_tokens(self, request: BenchRequest, cache: dict[str, int]) -> int:
        total = (
            1 if self.tokenizer and self.tokenizer.add_bos and self.tokenizer.bos_token_id is not None else 0
        )
        for part in request.parts:
            text = part if isinstance(part, str) else part.text
            if text not in cache:
                cache[text] = len(self.tokenizer.encode(text) if self.tokenizer else self.encode(text))  # type: ignore[misc]
            total += cache[text]
        return total

    def _size_pools(self) -> dict[str, float]:
        """GiB per engine: enough for everything the workload can ever write, so nothing is evicted,
        unless that exceeds config.kv_cache_gb; then the shared engines are cut down (and it is noted)."""
        bs = self.config.engine.block_size
        cache: dict[str, int] = {}
        requests = [
            -(-(self._num_tokens(r, cache) + self.config.continuation) // bs) for r in self.workload.requests
        ]
        docs = {d.text for r in self.workload.requests for d in r.docs}
        doc_blocks = sum(-(-(cache[text] + 1) // bs) for text in docs)
        num_splice = sum(s.splices for s in self.systems)
        need = {"off": max(requests) + 1}
        floor = dict(need)
        for key in ("hash", "radix"):
            if any(s.engine_key == key for s in self.systems):
                need[key], floor[key] = sum(requests) + 1, max(requests) + 1
        if num_splice:
            # The segment store holds its canonical context once (none without a tokenizer), and a
            # context sample (segment_kv.CONTEXTS > 1) holds a context and its segment while it runs: a
            # pool sized without them evicts the very segments the measured requests come to reuse.
            length = canonical_context_length(self.model_cfg, bs)
            context = length // bs if self.tokenizer else 0
            longest = max((cache[text] for text in docs), default=0)
            sample = context + -(-longest // bs) + 1 if context and segment_kv.CONTEXTS > 1 else 0
            # With lead KV the store holds two copies of each segment's KV.
            stored = doc_blocks * (2 if segment_kv.LEAD_KV and context else 1)
            need[SPLICE_ENGINE] = num_splice * (sum(requests) + stored) + context + sample + 1
            floor[SPLICE_ENGINE] = max(requests) + num_splice * stored + context + sample + 1
        cap = int(self.config.kv_cache_gb * GIB // self.block_bytes)
        blocks = split_pools(need, floor, cap)
        cut = [k for k in need if blocks[k] < need[k]]
        if cut:
            self.notes.append(
                f"KV pools capped at {self.config.kv_cache_gb:g} GiB in all (the workload could write "
                f"{sum(need.values()) * self.block_bytes / GIB:.1f} GiB); cut: {', '.join(cut)}. An "
                "engine whose pool is cut may evict; evictions that were seen are listed below."
            )
        # Half a block more, so that rounding never costs the pool its last block.
        return {k: (b + 0.5) * self.block_bytes / GIB for k, b in blocks.items()}

    def _engine(self, key: str, gib: float) -> _Engine:
        c = self.config
        try:
            engine = dataclasses.replace(
                c.engine,
                prefix_cache="radix" if key == SPLICE_ENGINE else key,
                # The prefix-cache systems and the reference reuse nothing beyond the prefix.
                auto_segments=c.engine.auto_segments and key == SPLICE_ENGINE,
                # Only segments go to the tiers below the pool: the other engines have none.
                store=c.engine.store if key == SPLICE_ENGINE else None,
                kv_cache_gb=gib,
                max_num_seqs=1,
            )
            llm = LLM(**dataclasses.asdict(engine))
        except Exception as err:  # every system on this engine is then reported as failed
            self.notes.append(f"engine {key!r} failed to start: {type(err).__name__}: {err}")
            return _Engine(None, f"engine failed to start: {type(err).__name__}: {err}")
        shift = llm.engine.segment_shift
        if key == SPLICE_ENGINE and shift:
            self.notes.append(
                f"splice systems repair with the segment shift at {shift:g} (the model family's)"
            )
        return _Engine(llm)

    # -- running ----------------------------------------------------------------------------------

    def run(self) -> list[RequestRecord]:
        requests = [r for r in self.workload.requests if not (self.config.skip_warmup and r.warmup)]
        total = sum(len(self.systems) - r.warmup for r in requests)
        records: list[RequestRecord] = []
        with tqdm(
            total=total, disable=not self.config.progress, unit="run", file=sys.stderr, dynamic_ncols=True
        ) as bar:
            for index, request in enumerate(requests):
                bar.set_description(f"{self.workload.name} {'warm-up' if request.warmup else 'measured'}")
                shift = index % len(self.systems)
                order = self.systems[shift:] + self.systems[:shift]
                results: dict[str, tuple[RequestRecord, torch.Tensor | None]] = {}
                for system in order:
                    if request.warmup and system.name == REFERENCE:
                        continue
                    bar.set_postfix_str(f"{request.request_id} on {system.name}")
                    results[system.name] = self._run_one(system, request)
                    bar.update()
                if not request.warmup:
                    _compare_all(results)
                records += [results[s.name][0] for s in self.systems if s.name in results]
        return records

    def _run_one(self, system: System, request: BenchRequest) -> tuple[RequestRecord, torch.Tensor | None]:
        record = RequestRecord.for_request(system.name, request)
        slot = self.engines[system.engine_key]
        if slot.llm is None:
            record.error = slot.error
            return record, None
        engine = slot.llm.engine
        before = engine.stats()
        used_before = before.num_used_blocks
        request_id = None
        try:
            prompt = prompt_parts(system, request, self.encode)
            options = RequestOptions(
                repair=system.policy,
                recompute_ratio=system.recompute_ratio,
                cache_salt=system.cache_salt,
                repair_fallback_margin=system.fallback_margin,
            )
            request_id = engine.add_request(prompt, self.params, options)
            # The request runs alone: step until the engine is idle, which includes the steps that store
            # the segments it missed (after its first token), so their KV counts for it.
            output, most, first = None, used_before, True
            while engine.has_unfinished():
                steps = engine.step()
                now = engine.stats()
                # The prefix cache indexes fewer tokens only when it evicted some.
                if first and now.prefix_cached_tokens < before.prefix_cached_tokens:
                    self.evictions[system.engine_key] += 1
                first = False
                most = max(most, now.num_used_blocks)
                done = (s.output for s in steps if s.request_id == request_id and s.output)
                output = output or next(done, None)
            if output is None:
                raise RuntimeError("the engine went idle without finishing the request")
        except Exception as err:  # a system that fails is reported as failed, never dropped
            record.error = f"{type(err).__name__}: {err}"
            if request_id is not None:
                try:
                    engine.abort(request_id)
                except Exception as abort_err:
                    record.error += f" (abort failed too: {abort_err})"
            return record, None
        m, after = output.metrics, engine.stats()
        peak = self.held[system.name] + max(most - used_before, 0)
        self.held[system.name] += after.num_used_blocks - used_before
        record.prompt_tokens = m.prompt_tokens
        record.prefix_hit_tokens = m.prefix_hit_tokens
        record.segment_hit_tokens = m.segment_hit_tokens
        record.segment_lead_tokens = m.segment_lead_tokens
        record.discovered_hit_tokens = m.discovered_hit_tokens
        record.computed_tokens = m.computed_tokens
        record.recomputed_tokens = m.recomputed_tokens
        record.fell_back = m.repair_fallback
        # Segments promoted from a tier below enter the pool's store too, but were loaded, not computed.
        promoted = sum(m.store_hit_tokens.values())
        record.store_tokens = after.segment_inserted_tokens - before.segment_inserted_tokens - promoted
        # Computing stored segments after more contexts is store work too.
        record.store_tokens += after.segment_sampled_tokens - before.segment_sampled_tokens
        assert record.store_tokens >= 0, "the store grew by less than the segments promoted into it"
        # Everything the engine computed in the background while the request ran to idle.
        record.background_flops = after.background_flops - before.background_flops
        record.store_hit_tokens = dict(m.store_hit_tokens)
        record.store_load_s = m.store_load_s
        record.prefill_flops = m.prefill_flops
        record.ttft_s = m.ttft_s
        record.kv_peak_bytes = peak * self.block_bytes
        record.token_ids = list(output.token_ids)
        record.text = output.text
        if request.answers and self.tokenizer is not None:
            record.correct = is_correct(output.text, request.answers, at_start=request.answer_at_start)
        return record, output.first_logits

    def close(self) -> dict[str, dict[str, dict[str, float]]]:
        """Close every engine (the splice engine's queued segments reach its tiers, so that a later run
        finds them) and return the counters of each engine's tiers, by engine and tier."""
        stats: dict[str, dict[str, dict[str, float]]] = {}
        for key, slot in self.engines.items():
            if slot.llm is None:
                continue
            engine = slot.llm.engine
            if not engine.flush(timeout_s=120.0):
                self.notes.append(f"the {key} engine's tier writes did not finish within 120 s")
            slot.llm.close()
            if engine.tier_stats is not None:
                stats[key] = {tier: dataclasses.asdict(s) for tier, s in engine.tier_stats().items()}
        return stats

    def check_evictions(self) -> None:
        for key, count in self.evictions.items():
            self.notes.append(
                f"the {key} engine's radix tree evicted entries while admitting {count} requests"
            )

    def note_store(self, records: list[RequestRecord]) -> None:
        """What the shared splice engine's segment store evicted and what its background work (more
        contexts per segment, lead KV) cost, warm-ups included: that work runs after the requests that
        bring a segment, often unmeasured warm-ups, so no request's record shows it."""
        splice = self.engines.get(SPLICE_ENGINE)
        if splice is None or splice.llm is None:
            return
        stats = splice.llm.engine.stats()
        prompts = max(1, sum(r.prompt_tokens for r in records if not r.warmup))
        if stats.segment_evictions:
            self.notes.append(
                f"the shared splice engine's segment store evicted {stats.segment_evictions} entries"
            )
        if stats.segment_lead_evictions:
            self.notes.append(
                "the shared splice engine's segment store dropped the lead KV of "
                f"{stats.segment_lead_evictions} entries it kept"
            )
        if segment_kv.CONTEXTS > 1:
            self.notes.append(
                f"segment_contexts={segment_kv.CONTEXTS}: the segment store computed "
                f"{stats.segment_sampled_tokens:,} tokens to give segments more contexts, "
                f"{stats.segment_sampled_tokens / prompts:.0%} of the measured requests' prompt tokens; "
                f"{stats.segment_contexts_dropped} contexts dropped"
            )
        if segment_kv.LEAD_KV and stats.segment_lead_tokens:
            self.notes.append(
                f"segment_lead_kv: the segment store computed {stats.segment_lead_tokens:,} tokens for "
                f"segments' KV at a prompt's start ({stats.segment_lead_tokens / prompts:.0%} of the "
                f"measured requests' prompt tokens) and spliced {stats.segment_lead_hit_tokens:,} tokens "
                f"from it; {stats.segment_leads_dropped} dropped"
            )
            measured = [r for r in records if not r.warmup and r.segment_hit_tokens]
            if measured:
                exact = sum(r.segment_lead_tokens for r in measured) / sum(
                    r.segment_hit_tokens for r in measured
                )
                self.notes.append(
                    f"segment_lead_kv: {exact:.0%} of the measured requests' segment tokens were spliced "
                    "from lead KV computed after the same prompt head (a full prefill's KV, left unrepaired)"
                )


def split_pools(need: dict[str, int], floor: dict[str, int], cap: int) -> dict[str, int]:
    """Blocks per engine within `cap`: every engine its need if that fits; else the single-system
    engines (off, hash, radix: one workload's worth each) keep theirs and the shared splice engine gets
    the rest, down to its floor; failing that, every engine gets its floor plus a share of the rest
    in proportion to its need beyond the floor."""
    if sum(need.values()) <= cap:
        return dict(need)
    single = {k: v for k, v in need.items() if k != SPLICE_ENGINE}
    if SPLICE_ENGINE in need and sum(single.values()) + floor[SPLICE_ENGINE] <= cap:
        return {**single, SPLICE_ENGINE: cap - sum(single.values())}
    spare = max(cap - sum(floor.values()), 0)
    extra = {k: need[k] - floor[k] for k in need}
    scale = spare / max(sum(extra.values()), 1)
    return {k: floor[k] + int(extra[k] * scale) for k in need}


def _compare_all(results: dict[str, tuple[RequestRecord, torch.Tensor | None]]) -> None:
    reference, ref_logits = results.get(REFERENCE, (None, None))
    if reference is None or ref_logits is None:
        return
    for record, logits in results.values():
        if logits is not None:
            compare(record, reference, logits, ref_logits)


def run_bench(config: BenchConfig, workload: Workload | None = None) -> BenchResult:
    """Run one workload on the configured systems; `workload` overrides the generated one (tests)."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = time.perf_counter()
    workload = workload or make_workload(config.workload, config.spec)
    if config.systems:
        systems = parse_systems(config.systems, config.budgets or DEFAULT_BUDGETS)
    else:
        systems = default_systems(config.budgets)
    if config.unmarked:
        systems += [unmarked(s) for s in systems if s.splices]
    machine = MachineInfo.collect()
    run = _Run(config, workload, systems)
    # Engines set torch's thread count; record the count they run with.
    machine = dataclasses.replace(machine, torch_threads=torch.get_num_threads())
    records = run.run()
    run.check_evictions()
    run.note_store(records)
    tier_stats = run.close()
    if config.skip_warmup:
        run.notes.append("warm-up requests not sent (--skip-warmup): shared content was new to every pool")
    names = [s.name for s in systems]
    return BenchResult(
        workload=workload.name,
        description=workload.description,
        corpus=workload.corpus,
        spec=dataclasses.asdict(workload.spec),
        systems=names,
        command=config.command or shlex.join(["kvsplice", "bench", workload.name]),
        machine=dataclasses.replace(machine, load_end=load_average()),
        model=_model_info(run),
        kv_pools_gib={k: round(v, 3) for k, v in run.pools.items()},
        continuation_tokens=config.continuation,
        records=records,
        summaries=summarize(records, names),
        turns=per_turn(records, names) if workload.has_turns else [],
        notes=run.notes,
        tier_stats=tier_stats,
        started=started,
        wall_s=time.perf_counter() - t0,
    )


def _model_info(run: _Run) -> ModelInfo | None:
    llm = next((e.llm for e in run.engines.values() if e.llm is not None), None)
    params = sum(p.numel() for p in llm.engine.model.parameters()) if llm is not None else 0
    cfg, c = run.model_cfg, run.config.engine
    name = c.model if c.model is not None else "Gemma 3 270M (the default: its Q4_K_M GGUF, dequantised)"
    return ModelInfo(
        name=name,
        architecture=cfg.architecture,
        parameters=params,
        layers=cfg.num_layers,
        dtype=c.dtype,
        kv_dtype=c.kv_dtype,
        block_size=c.block_size,
        kv_bytes_per_token=run.block_bytes // c.block_size,
        has_tokenizer=run.tokenizer is not None,
    )
