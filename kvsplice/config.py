"""The one engine configuration. The Python API (`LLM(**kwargs)`), the CLI and the server all build it
from the same fields, and it is validated once, here."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvsplice.cache.registry import PREFIX_CACHE_NAMES
from kvsplice.errors import ConfigError
from kvsplice.repair.registry import POLICY_NAMES
from kvsplice.tiers.config import StoreConfig
from kvsplice.tiers.publisher import KVEventsConfig

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
    repair: str = _opt(
        "repair policy for reused segments (docs/design.md says why attention)", default="attention"
    )
    recompute_ratio: float = _opt("repair budget as a fraction of the reused segment tokens", default=0.15)
    repair_fallback_margin: float = _opt(
        "prefill in full a request whose first token, after repair, leads its runner-up by less than this "
        "probability, in [0, 1]: where the spliced answer is a near-tie it is not trusted; 0: never",
        default=0.0,
    )
    auto_segments: bool = _opt(
        "reuse without markup: find spans a prompt shares with earlier prompts (RAG passages, re-sent "
        "tool outputs) and splice them like marked segments; --no-auto-segments turns it off",
        default=True,
    )
    seed: int = _opt("seed for sampling when a request gives none", default=0)
    fidelity_target: float = _opt(
        "the trust gate's quality target: the mean first-token KL from a full prefill (nats) each prompt "
        "shape is kept within, by prefilling in full the near-ties its audits say need it; 0: no gate",
        default=0.05,
    )
    audit_ratio: float = _opt(
        "share of spliced requests also prefilled in full as background work, to measure how far "
        "splicing is from a full prefill on this traffic (GET /audit, /metrics); 0: off",
        default=0.02,
    )
    store: StoreConfig | None = field(
        default=None,
        metadata={
            "help": "tiers below the KV pool (disk, Redis) where segments' KV outlives the process and is "
            "shared by replicas: a StoreConfig or a dict of its fields (default: none)"
        },
    )
    kv_events: KVEventsConfig | None = field(
        default=None,
        metadata={
            "help": "publish KV events in vLLM's format over ZeroMQ: a KVEventsConfig or a dict of its "
            "fields (default: off)"
        },
    )

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
        _check(0.0 <= self.repair_fallback_margin <= 1.0, "repair_fallback_margin must be in [0, 1]")
        _check(0.0 <= self.audit_ratio <= 1.0, "audit_ratio must be in [0, 1]")
        _check(0.0 <= self.fidelity_target < math.inf, "fidelity_target must be a finite KL >= 0")
        _check(self.prefix_cache in PREFIX_CACHE_NAMES, f"prefix_cache must be one of {PREFIX_CACHE_NAMES}")
        _check(self.repair in POLICY_NAMES, f"repair must be one of {POLICY_NAMES}")
        for name, cls in NESTED.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                try:
                    value = cls(**value)
                except TypeError as err:
                    raise ConfigError(f"{name}: {err}") from err
                # Frozen: the one place a field is replaced, by its validated form.
                object.__setattr__(self, name, value)
            _check(
                value is None or isinstance(value, cls),
                f"{name} must be a {cls.__name__}, a dict of its fields, or None",
            )

    @property
    def threads(self) -> int:
        """Torch's intra-op threads: num_threads, or half the CPUs this process may use (at least 1).
        Threads that wait on each other while other processes hold a core cost more than they give
        (docs/design.md says why half)."""
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
        those per engine); a nested configuration's fields become --store-* and --kv-events-* options."""
        for f in dataclasses.fields(EngineConfig):
            if f.name in exclude:
                continue
            if f.name in NESTED:
                for nested in dataclasses.fields(NESTED[f.name]):
                    flag = _flag(f.name, nested.name)
                    help_text = f"{nested.metadata['help']} (default: {nested.default})"
                    # None: not given, so that from_args can tell which nested fields were set.
                    parser.add_argument(flag, type=_arg_type(nested), default=None, help=help_text)
                continue
            flag, help_text = "--" + f.name.replace("_", "-"), f.metadata["help"]
            if str(f.type) == "bool":
                on_off = argparse.BooleanOptionalAction  # --flag / --no-flag
                parser.add_argument(flag, action=on_off, default=f.default, help=help_text)
                continue
            parser.add_argument(flag, type=_arg_type(f), default=f.default, help=help_text)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        """The configuration a parser built by add_args parsed (excluded fields keep their defaults)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in NESTED:
                if hasattr(args, f.name):
                    values[f.name] = getattr(args, f.name)
                continue
            given = {
                n.name: getattr(args, _dest(f.name, n.name))
                for n in dataclasses.fields(NESTED[f.name])
                if getattr(args, _dest(f.name, n.name), None) is not None
            }
            switches = NESTED_SWITCHES[f.name]
            if given and not given.keys() & switches:
                flags = " or ".join(_flag(f.name, s) for s in sorted(switches))
                raise ConfigError(f"{', '.join(_flag(f.name, n) for n in given)} need {flags}")
            values[f.name] = given or None
        return cls(**values)


# The nested configurations, and the fields that turn each on from the CLI.
NESTED: dict[str, type[StoreConfig] | type[KVEventsConfig]] = {
    "store": StoreConfig,
    "kv_events": KVEventsConfig,
}
NESTED_SWITCHES = {"store": frozenset({"store_dir", "store_url"}), "kv_events": frozenset({"endpoint"})}


def _dest(group: str, name: str) -> str:
    """The argparse destination of a nested field: StoreConfig's fields already start with store_."""
    return name if name.startswith(group) else f"{group}_{name}"


def _flag(group: str, name: str) -> str:
    return "--" + _dest(group, name).replace("_", "-")


def _arg_type(f: dataclasses.Field[Any]) -> Callable[[str], Any]:
    return {"int | None": int, "int": int, "float": float, "float | None": float}.get(str(f.type), str)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
