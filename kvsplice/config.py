"""The one engine configuration. The Python API (`LLM(**kwargs)`), the CLI and the server all build it
from the same fields, and it is validated once, here."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsplice.cache.registry import PREFIX_CACHE_NAMES
from kvsplice.errors import ConfigError
from kvsplice.repair.registry import POLICY_NAMES
from kvsplice.store.config import StoreConfig
from kvsplice.store.publisher import KVEventsConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _opt(help_text: str, **kwargs: Any) -> Any:
    return field(metadata={"help": help_text}, **kwargs)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = _opt(
        "model name (gemma3-270m, smollm2), Hugging Face directory or .gguf file (default: gemma3-270m)",
        default=None,
    )
    device: str = _opt("torch device to run on", default="cpu")
    dtype: str = _opt("compute dtype", default="float32")
    kv_dtype: str = _opt("dtype of the stored KV", default="float32")
    num_threads: int | None = _opt(
        "torch intra-op threads (default: half the CPUs this process may use, at least 1; see `threads`)",
        default=None,
    )
    block_size: int = _opt("tokens per KV block", default=16)
    kv_cache_gb: float = _opt("memory for the KV pool, in GiB, allocated up front", default=1.0)
    max_model_len: int | None = _opt("longest prompt + output (default: the model's context)", default=None)
    max_num_seqs: int = _opt("requests running at once (decode batch size)", default=16)
    max_num_batched_tokens: int = _opt(
        "tokens one engine step computes at most: decode tokens plus prefill chunks (vLLM's name)",
        default=256,
    )
    long_prefill_token_threshold: int | None = _opt(
        "a prompt in prefill takes at most this many tokens of a step before every other prefill has had "
        "its share (default: a quarter of max_num_batched_tokens)",
        default=None,
    )
    max_waiting: int = _opt(
        "requests queued beyond the running ones before new ones are refused", default=256
    )
    prefix_cache: str = _opt("prefix cache: hash (vLLM), radix (SGLang) or off", default="radix")
    # lead: lowest next-token KL at a 15% budget on the recall evaluation, on both models (Gemma 3,
    # 90 requests: 0.106 against query's 0.139, first token 87% against 79%; 4 and 8 documents with
    # its half-budget cap: 0.081 and 0.055 against 0.089 and 0.095; SmolLM2: 0.190 against 0.245),
    # because the damage concentrates where the answer is in the first document
    # (bench/results/recall_gemma_8docs_n90, recall_gemma_lead_share, recall_smollm2_8docs_lead).
    # margin, at the same FLOPs, halves lead's KL on SmolLM2's recall prompts, but answered fewer of
    # them (360 held-out requests: -1.7 points [-4.2, +0.6]) with a TTFT 18% longer (repair/margin.py).
    repair: str = _opt("repair policy for reused segments", default="lead")
    recompute_ratio: float = _opt(
        "repair budget as a fraction of the reused segment tokens; margin pays its probe's extra cost out "
        "of it, so every policy costs about what lead does at the same ratio",
        default=0.15,
    )
    recompute_tokens: int | None = _opt("repair budget in tokens (overrides the ratio)", default=None)
    repair_target: float = _opt(
        "quality target of the adaptive repair policy: it stops when another round of repair moves the "
        "next-token distribution by at most this KL (nats)",
        default=0.05,
    )
    repair_shift: float | None = _opt(
        "how much of the KV error a reused segment's recomputed tokens show is added to its other tokens "
        "on each layer (repair/shift.py), in [0, 1] (default: the model family's, 0.5 on Gemma 3, where "
        "held-out runs measured it closer to a full prefill, and 0 elsewhere)",
        default=None,
    )
    repair_fallback_margin: float = _opt(
        "prefill in full a request whose first token, after repair, leads its runner-up by less than this "
        "probability, in [0, 1]: where the spliced answer is a near-tie it is not trusted "
        "(bench/gate.py replays it on recorded runs); 0: never",
        default=0.0,
    )
    segment_context_tokens: int | None = _opt(
        "length of the canonical context stored segments are computed after "
        "(default: 1024, or the model's sliding window + 64 where that is more; at most half the model's "
        "positions)",
        default=None,
    )
    # 4, by measurement on recall (8 documents, lead@15, 30 requests): KL to the full prefill 0.062 ->
    # 0.035 on Gemma 3, 0.169 -> 0.115 on SmolLM2, for background work of about 3x each new segment's
    # tokens (reuse/store_fill.py).
    segment_contexts: int = _opt(
        "contexts a stored segment's KV is the mean over: after it is stored, the segment is computed "
        "after n - 1 more contexts made of other stored segments, as background work (1: off)",
        default=4,
    )
    segment_lead_kv: bool = _opt(
        "also keep each stored segment's KV computed at the start of a prompt (after the head of the "
        "prompt that carried it: BOS and up to 64 tokens of instruction), as background work, and "
        "splice it where a prompt starts with the segment: there the KV computed after other content "
        "is furthest from a full prefill's, and after the same head the lead KV is a full prefill's; "
        "the store then holds two copies of each segment's KV; --no-segment-lead-kv turns it off",
        default=True,
    )
    auto_segments: bool = _opt(
        "reuse without markup: find spans a prompt shares with earlier prompts (RAG passages, re-sent "
        "tool outputs) and splice them like marked segments; --no-auto-segments turns it off",
        default=True,
    )
    auto_segment_min_tokens: int = _opt(
        "the shortest shared span auto_segments splices (the span index finds every span of >= 63 tokens)",
        default=64,
    )
    seed: int = _opt("seed for sampling when a request gives none", default=0)
    store_dir: str | None = _opt(
        "directory of the disk tier below the KV pool: segments' KV outlives the process (default: off)",
        default=None,
    )
    store_disk_gb: float = _opt("byte budget of store_dir, in GiB (least recently used out)", default=8.0)
    store_url: str | None = _opt(
        "redis://host:port/db of a Redis or Valkey tier shared by replicas (default: off)", default=None
    )
    store_ttl_s: int | None = _opt(
        "seconds a remote entry lives (default: until the server's maxmemory policy evicts it)", default=None
    )
    store_dtype: str | None = _opt(
        "dtype the disk and Redis tiers store KV in (default: kv_dtype; float16 halves float32's bytes, "
        "bench/results/store_fidelity.md measures what it costs)",
        default=None,
    )
    store_timeout_s: float = _opt(
        "connect and read/write timeout of the Redis tier, in seconds: a dead server costs at most this",
        default=0.25,
    )
    store_breaker_failures: int = _opt(
        "consecutive Redis failures that open the circuit breaker (requests then skip the tier)", default=3
    )
    store_breaker_cooldown_s: float = _opt(
        "seconds the Redis circuit stays open before one probe request tries the server again", default=5.0
    )
    kv_events_endpoint: str | None = _opt(
        "ZeroMQ address to publish KV events on in vLLM's format, e.g. tcp://*:5557 (default: off)",
        default=None,
    )
    kv_events_replay_endpoint: str | None = _opt(
        "ZeroMQ address of the KV events replay socket (default: no replay)", default=None
    )
    kv_events_topic: str = _opt("topic of KV event messages (llm-d reads kv@<pod>@<model>)", default="")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES or self.kv_dtype not in DTYPES:
            raise ConfigError(f"dtype and kv_dtype must be one of {sorted(DTYPES)}")
        try:
            torch.device(self.device)
        except RuntimeError as err:
            raise ConfigError(f"invalid device {self.device!r}: {err}") from err
        _check(self.block_size >= 1, "block_size must be >= 1")
        _check(self.kv_cache_gb > 0, "kv_cache_gb must be > 0")
        _check(self.num_threads is None or self.num_threads >= 1, "num_threads must be >= 1")
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _check(self.max_num_seqs >= 1, "max_num_seqs must be >= 1")
        _check(
            self.max_num_batched_tokens > self.max_num_seqs,
            "max_num_batched_tokens must exceed max_num_seqs (every running request decodes each step)",
        )
        _check(
            self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 1,
            "long_prefill_token_threshold must be >= 1",
        )
        _check(self.max_waiting >= 0, "max_waiting must be >= 0")
        _check(0.0 <= self.recompute_ratio <= 1.0, "recompute_ratio must be in [0, 1]")
        _check(self.recompute_tokens is None or self.recompute_tokens >= 0, "recompute_tokens must be >= 0")
        _check(0.0 <= self.repair_target < float("inf"), "repair_target must be >= 0")
        _check(self.repair_shift is None or 0.0 <= self.repair_shift <= 1.0, "repair_shift must be in [0, 1]")
        _check(0.0 <= self.repair_fallback_margin <= 1.0, "repair_fallback_margin must be in [0, 1]")
        _check(
            self.segment_context_tokens is None or self.segment_context_tokens >= 0,
            "segment_context_tokens must be >= 0",
        )
        _check(self.prefix_cache in PREFIX_CACHE_NAMES, f"prefix_cache must be one of {PREFIX_CACHE_NAMES}")
        _check(self.auto_segment_min_tokens >= 1, "auto_segment_min_tokens must be >= 1")
        _check(self.segment_contexts >= 1, "segment_contexts must be >= 1")
        _check(self.repair in POLICY_NAMES, f"repair must be one of {POLICY_NAMES}")
        _check(self.store_disk_gb > 0, "store_disk_gb must be > 0")
        # Both raise ConfigError for a bad field.
        self.store_config()
        self.kv_events_config()

    def store_config(self) -> StoreConfig:
        """The tiers below the pool (none when neither store_dir nor store_url is set)."""
        return StoreConfig(
            store_dir=self.store_dir,
            store_dir_bytes=int(self.store_disk_gb * 2**30),
            store_url=self.store_url,
            store_ttl_s=self.store_ttl_s,
            store_timeout_s=self.store_timeout_s,
            store_breaker_failures=self.store_breaker_failures,
            store_breaker_cooldown_s=self.store_breaker_cooldown_s,
            store_dtype=self.store_dtype,
        )

    def kv_events_config(self) -> KVEventsConfig | None:
        if self.kv_events_endpoint is None:
            _check(
                self.kv_events_replay_endpoint is None, "kv_events_replay_endpoint needs kv_events_endpoint"
            )
            return None
        return KVEventsConfig(
            endpoint=self.kv_events_endpoint,
            replay_endpoint=self.kv_events_replay_endpoint,
            topic=self.kv_events_topic,
        )

    @property
    def threads(self) -> int:
        """Torch's intra-op threads: num_threads, or half the CPUs this process may use (at least 1).
        Measured (bench/results/serve_concurrency.md, `--num-threads 1 0`): on the shared 2-core
        machine, one thread served 8 concurrent clients 1.7x faster than torch's default of two
        (17-19 against 10-11 tokens/s) and one client 1.1x faster: threads that wait on each other
        while other processes hold a core cost more than they give."""
        if self.num_threads is not None:
            return self.num_threads
        return max(1, len(os.sched_getaffinity(0)) // 2)

    def describe_threads(self) -> str:
        """What `kvsplice generate` and `serve` print about the thread count they chose."""
        how = (
            "as asked"
            if self.num_threads is not None
            else "half the CPUs, the default; --num-threads to change"
        )
        return f"{self.threads} torch thread(s) ({how})"

    @property
    def prefill_chunk_cap(self) -> int:
        return self.long_prefill_token_threshold or max(1, self.max_num_batched_tokens // 4)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_dtype]

    @staticmethod
    def add_args(
        parser: argparse.ArgumentParser | argparse._ArgumentGroup, exclude: frozenset[str] = frozenset()
    ) -> None:
        """Add one --option per field to a CLI parser, but for the fields in `exclude` (the bench sets
        those per engine)."""
        for f in dataclasses.fields(EngineConfig):
            if f.name in exclude:
                continue
            flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
            if str(f.type) == "bool":
                on_off = argparse.BooleanOptionalAction  # --flag / --no-flag
                parser.add_argument(flag, action=on_off, default=f.default, help=help_text)
                continue
            kind = {"int | None": int, "int": int, "float": float, "float | None": float}.get(
                str(f.type), str
            )
            parser.add_argument(flag, type=kind, default=f.default, help=help_text)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The configuration a parser built by add_args parsed (excluded fields keep their defaults)."""
        return cls(
            **{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        )


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
