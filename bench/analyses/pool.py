"""One system's fidelity pooled over bench runs of other requests (other seeds).

    python bench/analyses/pool.py DIR [DIR ...] --system splice:lead@15
    python bench/analyses/pool.py DIR DIR=splice:lead@15 --system splice:lead@15+shift0.5

A run of 100 requests measures an accuracy difference to about ±5 points; the fidelity targets ask about
two ("never more than 2 points below"), and the table says how many requests, in the pooled proportions
of answers won, lost and kept, an interval would need to show it. Runs of one workload on other seeds
measure other requests, so their paired outcomes pool: per model and setting, the paired accuracy
difference against the full prefill of the same requests (Newcombe's interval over every pair), the mean
next-token KL, the share within KL_CLOSE and the first-token agreement (Wilson intervals), and the
agreement where the full prefill leads its runner-up by at least each of MARGINS probability (below that
it is torn, and any perturbation may flip it). Two runs of one model, setting and seed measured the same
requests and are refused, as are runs of other workload sizes: the pool would count requests twice, or
mix evaluations. Runs made at different commits pool as given; the table names the commits.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsplice.bench.metrics import KL_CLOSE, RequestRecord
from kvsplice.bench.results import BenchResult
from kvsplice.bench.stats import Interval, paired_difference, requests_to_show, wilson

# Full-prefill margins (top-1 minus runner-up probability) at which first-token agreement is reported.
MARGINS = (0.02, 0.1, 0.2)
# The accuracy the default may lose at most against the full prefill (fidelity target: 2 points).
FLOOR = -0.02
# Spec entries that may differ between pooled runs: they choose which requests, not what kind.
_PER_RUN = ("seed", "requests")


@dataclass(frozen=True)
class Pair:
    """A request on the system and on the full prefill (`off`) in the same run."""

    system: RequestRecord
    reference: RequestRecord


@dataclass(frozen=True)
class Led:
    """First-token agreement on the requests whose full prefill leads by at least `margin`."""

    margin: float
    requests: int
    top1: Interval | None


@dataclass(frozen=True)
class Pooled:
    model: str
    setting: str
    seeds: tuple[int, ...]
    commits: tuple[str, ...]
    requests: int
    accuracy: float
    reference_accuracy: float
    # accuracy(system) - accuracy(full prefill), paired.
    accuracy_delta: Interval
    # Requests in these proportions whose interval would show the loss within FLOOR (None: never).
    to_show: int | None
    kl_mean: float
    close: Interval
    top1: Interval
    # One per margin in MARGINS.
    led: tuple[Led, ...]


def pairs(result: BenchResult, system: str) -> dict[str, list[Pair]]:
    """The measured requests both `system` and the full prefill answered, by setting; ValueError for a
    workload without answers to judge (chat, agent)."""
    if system not in result.systems:
        raise ValueError(f"the run ({result.command}) has no system {system!r}; it has {result.systems}")
    done = [r for r in result.records if not r.warmup and r.ok]
    reference = {r.request_id: r for r in done if r.system == "off"}
    by_setting: dict[str, list[Pair]] = {}
    for r in done:
        if r.system == system and r.request_id in reference:
            assert r.kl is not None and r.top1 is not None, "a compared record"
            if r.correct is None:
                raise ValueError(f"the run ({result.command}) has no answers to judge")
            by_setting.setdefault(r.setting, []).append(Pair(r, reference[r.request_id]))
    return by_setting


def pool(runs: Sequence[BenchResult], system: str | Sequence[str]) -> list[Pooled]:
    """`system` against the full prefill per (model, setting), over every run; ValueError for runs that
    measured the same requests twice or another kind of workload. `system` is one name for every run,
    or one per run (a system whose name changed between runs, as when a default did)."""
    names = [system] * len(runs) if isinstance(system, str) else list(system)
    if len(names) != len(runs):
        raise ValueError(f"{len(names)} system names for {len(runs)} runs: name one, or one per run")
    groups: dict[tuple[str, str], list[tuple[BenchResult, list[Pair]]]] = {}
    kinds: dict[str, tuple[str, dict[str, object], str]] = {}
    for result, name in zip(runs, names, strict=True):
        model = _model(result)
        kind = {k: v for k, v in result.spec.items() if k not in _PER_RUN}
        first = kinds.setdefault(model, (result.workload, kind, result.command))
        if (first[0], first[1]) != (result.workload, kind):
            raise ValueError(
                f"{result.command!r} is another evaluation than {first[2]!r} "
                f"({result.workload} {kind} against {first[0]} {first[1]}): they do not pool"
            )
        for setting, found in pairs(result, name).items():
            groups.setdefault((model, setting), []).append((result, found))
    out = []
    for (model, setting), members in groups.items():
        seeds = [int(result.spec.get("seed", 0)) for result, _ in members]
        if len(set(seeds)) < len(seeds):
            raise ValueError(f"{model}, {setting}: two runs of seed {max(seeds, key=seeds.count)} measured "
                             "the same requests; pool runs of other seeds")  # fmt: skip
        both = [p for _, found in members for p in found]
        commits = dict.fromkeys(result.machine.git_commit or "?" for result, _ in members)
        out.append(_pooled(model, setting, tuple(seeds), tuple(commits), both))
    return out


def _model(result: BenchResult) -> str:
    """The model by its weights, not its display name (which changed between commits)."""
    m = result.model
    if m is None:
        return "unknown model"
    return f"{m.architecture} {m.parameters / 1e6:.0f}M {m.dtype}, KV {m.kv_dtype}"


def _pooled(
    model: str, setting: str, seeds: tuple[int, ...], commits: tuple[str, ...], both: list[Pair]
) -> Pooled:
    n = len(both)
    kls = [p.system.kl or 0.0 for p in both]
    outcomes = [(bool(p.system.correct), bool(p.reference.correct)) for p in both]
    delta = paired_difference(outcomes)
    close = wilson(sum(kl <= KL_CLOSE for kl in kls), n)
    top1 = wilson(sum(bool(p.system.top1) for p in both), n)
    assert delta is not None and close is not None and top1 is not None, "a setting has pairs"
    led = []
    for margin in MARGINS:
        sure = [bool(p.system.top1) for p in both if (p.system.reference_margin or 0.0) >= margin]
        led.append(Led(margin, len(sure), wilson(sum(sure), len(sure))))
    return Pooled(
        model,
        setting,
        seeds,
        commits,
        n,
        sum(bool(p.system.correct) for p in both) / n,
        sum(bool(p.reference.correct) for p in both) / n,
        delta,
        requests_to_show(outcomes, FLOOR),
        sum(kls) / n,
        close,
        top1,
        tuple(led),
    )


def interval(i: Interval | None, signed: bool = False) -> str:
    """An interval in percent (points where `signed`), for a table cell; "–" for none."""
    if i is None:
        return "–"
    if signed:
        return f"{100 * i.estimate:+.1f} [{100 * i.low:+.1f}, {100 * i.high:+.1f}]"
    return f"{100 * i.estimate:.1f}% [{100 * i.low:.0f}, {100 * i.high:.0f}]"


def _shown(r: Pooled) -> str:
    """How many requests the pooled proportions need to show the accuracy within FLOOR."""
    if r.to_show is None:
        return "never (estimate below)" if r.accuracy_delta.estimate <= FLOOR else "over a million"
    if r.to_show <= r.requests and r.accuracy_delta.low >= FLOOR:
        return "shown"
    return f"{r.to_show:,}"


def table(rows: Sequence[Pooled], system: str) -> str:
    led = " | ".join(f"first token, full leads by ≥ {m:g}" for m in MARGINS)
    out = [
        f"`{system}` against the full prefill of the same requests, pooled over runs (95% intervals)",
        "",
        f"| model | setting | requests (seeds) | accuracy (full) | Δ accuracy, points "
        f"| requests to show Δ ≥ {100 * FLOOR:g} | KL | KL ≤ {KL_CLOSE:g} | first token | {led} | commits |",
        "|---|---|---|---|---:|---:|---:|---:|---:|" + "---:|" * len(MARGINS) + "---|",
    ]
    for r in rows:
        shares = " | ".join(f"{interval(x.top1)} of {x.requests}" for x in r.led)
        out.append(
            f"| {r.model} | {r.setting} | {r.requests} ({', '.join(map(str, r.seeds))}) "
            f"| {100 * r.accuracy:.1f}% ({100 * r.reference_accuracy:.1f}%) "
            f"| {interval(r.accuracy_delta, True)} | {_shown(r)} | {r.kl_mean:.4f} | {interval(r.close)} "
            f"| {interval(r.top1)} | {shares} | {', '.join(r.commits)} |"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python bench/analyses/pool.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "runs",
        nargs="+",
        help="run directories, each with a results.json; DIR=SYSTEM pools that run's SYSTEM instead",
    )
    parser.add_argument("--system", required=True, help="the splice system to pool, e.g. splice:lead@15")
    args = parser.parse_args(argv)
    try:
        # "DIR=SYSTEM": the same system under another name in that run.
        named = [(Path(d), s or args.system) for d, _, s in (arg.partition("=") for arg in args.runs)]
        runs = [BenchResult.from_json((d / "results.json").read_text()) for d, _ in named]
        rows = pool(runs, [s for _, s in named])
    except (ValueError, OSError) as err:
        # Runs that do not pool, or a directory without results: the user's mistake, one line.
        parser.error(str(err))
    print(table(rows, args.system))


if __name__ == "__main__":
    main()
