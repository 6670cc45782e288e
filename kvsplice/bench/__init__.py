"""`kvsplice bench`: every claim from one command, with the baselines beside it.

    from kvsplice.bench import BenchConfig, WorkloadSpec, run_bench, write_report
    result = run_bench(BenchConfig("rag", WorkloadSpec(requests=4), systems=("hash", "radix", "splice")))
    print(write_report(result, Path("out/bench/rag")))

Modules: workloads (rag, qa, fewshot), conversations (chat, agent) and recall generate requests; systems
names what runs; runner runs and measures; metrics defines the measures and their summaries (per
system, turn, setting and answer position), stats their confidence intervals; report and plots write
them. Analyses across recorded runs are scripts under bench/analyses/, outside the package.
"""

from kvsplice.bench.base import BenchRequest, Doc, Workload, WorkloadSpec
from kvsplice.bench.harness import BenchConfig, run_bench
from kvsplice.bench.metrics import RequestRecord, SystemSummary, TurnSummary
from kvsplice.bench.report import markdown
from kvsplice.bench.report import write as write_report
from kvsplice.bench.results import BenchResult
from kvsplice.bench.systems import System, parse_systems
from kvsplice.bench.workloads import WORKLOADS, make_workload

__all__ = [
    "WORKLOADS",
    "BenchConfig",
    "BenchRequest",
    "BenchResult",
    "Doc",
    "RequestRecord",
    "System",
    "SystemSummary",
    "TurnSummary",
    "Workload",
    "WorkloadSpec",
    "make_workload",
    "markdown",
    "parse_systems",
    "run_bench",
    "write_report",
]
