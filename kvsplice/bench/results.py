"""The result of one bench run (what results.json holds) and the machine it ran on."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvsplice.bench.metrics import RequestRecord, SystemSummary, TurnSummary


@dataclass(frozen=True)
class MachineInfo:
    cpu: str
    cores: int | None
    torch_threads: int
    torch_version: str
    python: str
    platform: str
    # 1-, 5- and 15-minute load averages at the start and the end of the run (None off Unix).
    load_start: tuple[float, float, float] | None
    load_end: tuple[float, float, float] | None = None
    git_commit: str | None = None
    # kvsplice source files with uncommitted changes when the run started.
    git_modified: tuple[str, ...] = ()

    @staticmethod
    def collect() -> MachineInfo:
        return MachineInfo(
            cpu=cpu_name(),
            cores=os.cpu_count(),
            torch_threads=torch.get_num_threads(),
            torch_version=torch.__version__,
            python=platform.python_version(),
            platform=platform.platform(),
            load_start=load_average(),
            git_commit=_git(["rev-parse", "--short", "HEAD"]),
            git_modified=tuple(
                line[3:]
                for line in (_git(["status", "--porcelain", "--untracked-files=no"]) or "").splitlines()
                if line[3:].startswith("kvsplice/")
            ),
        )


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    parameters: int
    layers: int
    dtype: str
    kv_dtype: str
    block_size: int
    # KV bytes per token of this model in kv_dtype.
    kv_bytes_per_token: int
    has_tokenizer: bool


@dataclass
class BenchResult:
    workload: str
    description: str
    corpus: str
    spec: dict[str, Any]
    systems: list[str]
    command: str
    machine: MachineInfo
    model: ModelInfo | None
    # GiB of KV pool per engine ("off", "hash", "radix", "splice").
    kv_pools_gib: dict[str, float]
    continuation_tokens: int
    records: list[RequestRecord]
    summaries: list[SystemSummary]
    turns: list[TurnSummary]
    # Warnings about the run (capped pools, evictions, engines that failed to start).
    notes: list[str] = field(default_factory=list)
    # Counters of the tiers below the pool (TierStats fields), by engine and tier, at the end of the run.
    tier_stats: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    started: str = ""
    wall_s: float = 0.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def write_json(self, path: Path) -> None:
        path.write_text(self.to_json() + "\n")

    @staticmethod
    def from_json(text: str) -> BenchResult:
        raw = json.loads(text)
        machine = raw.pop("machine")
        for key in ("load_start", "load_end"):
            machine[key] = tuple(machine[key]) if machine[key] is not None else None
        machine["git_modified"] = tuple(machine.get("git_modified", ()))
        model = raw.pop("model")
        # JSON has no tuples: sizes that are tuples (doc_counts) come back as lists.
        raw["spec"] = {k: tuple(v) if isinstance(v, list) else v for k, v in raw["spec"].items()}
        return BenchResult(
            machine=MachineInfo(**machine),
            model=ModelInfo(**model) if model else None,
            records=[RequestRecord(**r) for r in raw.pop("records")],
            summaries=[SystemSummary(**s) for s in raw.pop("summaries")],
            turns=[TurnSummary(**t) for t in raw.pop("turns")],
            **raw,
        )


def cpu_name() -> str:
    """The CPU's model name (Linux), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn: Callable[[], object]) -> float:
    """Wall-clock seconds of one call of fn."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def load_average() -> tuple[float, float, float] | None:
    """1-, 5- and 15-minute load averages: how far other processes may have slowed a measurement."""
    try:
        one, five, fifteen = os.getloadavg()
    except (OSError, AttributeError):
        return None
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def _git(args: list[str]) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args],
            cwd=Path(__file__).resolve().parents[2],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
