"""The systems a bench run puts side by side, by name:

    off                     no cache; documents as plain text. Always run: the full-prefill reference.
    hash                    vLLM's hash-chain prefix cache; documents as plain text.
    radix                   SGLang's radix-tree prefix cache; documents as plain text.
    splice:<policy>@<pct>   documents as `Segment`s, over the radix prefix cache, repaired by <policy>
                            with a budget of <pct>% of the reused segment tokens.
    splice:adaptive         the same, repaired by the adaptive policy, which stops at a quality target
                            rather than a budget (repair/adaptive.py).
    <splice system>+fallback<m> the same, prefilled in full where repair leaves the first token
                            leading its runner-up by less than m (a probability; without the suffix:
                            the engine's repair_fallback_margin).
    <splice system>/plain   the same, the prompt sent unmarked as one plain string (`--unmarked` adds
                            one per splice system): reuse beyond the prefix is what auto_segments finds.

`splice` alone stands for every policy at every budget, `splice:<policy>` for one policy at every
budget; `none` runs only at 0% and `full` only at 100% (anything else would duplicate them), and the
other policies run at the budgets strictly between. By default only the engine's repair policy runs,
at the engine's budget; the published baselines (splice:none, splice:boundary, splice:deviation) and
the other policies are one --systems away.

All splice systems share one engine: the policy and budget are per-request arguments, and each system
has its own cache salt, so its prefix cache and segment store are its own.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsplice.bench.base import BenchRequest, Doc
from kvsplice.config import EngineConfig
from kvsplice.prompt import Part, Segment
from kvsplice.repair.registry import POLICIES, POLICY_NAMES

REFERENCE = "off"
PREFIX_SYSTEMS = ("off", "hash", "radix")
# Budgets for systems named without one: the engine's (rounded: 0.15 * 100 is not 15 in floats); the
# sweep is one flag away (--budgets 0 5 10 15 30 100 with --systems splice).
DEFAULT_BUDGETS = (round(EngineConfig.recompute_ratio * 100, 6),)
SWEEP_BUDGETS = (0.0, 5.0, 10.0, 15.0, 30.0, 100.0)
SPLICE_ENGINE = "splice"
# The default systems of every workload: the prefix caches and what the engine does by default, its
# repair policy at its budget, so that a default run is short (every policy: --systems splice).
DEFAULT_SYSTEMS = ("off", "hash", "radix", f"splice:{EngineConfig.repair}")


@dataclass(frozen=True)
class System:
    name: str
    # The prefix cache of the system's engine.
    prefix_cache: str
    # Splicing systems: the repair policy and its budget in percent of the reused segment tokens (None:
    # the engine's default, or a policy without a budget).
    policy: str | None = None
    budget_pct: float | None = None
    # Documents go as Segments (splicing systems); False: the whole prompt as one plain string.
    marked: bool = True
    # The first-token margin below which a request is prefilled in full (None: the engine's).
    fallback_margin: float | None = None

    @property
    def splices(self) -> bool:
        return self.policy is not None

    @property
    def engine_key(self) -> str:
        """Systems with the same key run on the same engine."""
        return SPLICE_ENGINE if self.splices else self.prefix_cache

    @property
    def cache_salt(self) -> str | None:
        return self.name if self.splices else None

    @property
    def recompute_ratio(self) -> float | None:
        return None if self.budget_pct is None else self.budget_pct / 100.0


def unmarked(system: System) -> System:
    """The splice system's twin that sends prompts without markup."""
    assert system.splices
    return dataclasses.replace(system, name=system.name + "/plain", marked=False)


def splice_system(policy: str, budget_pct: float) -> System:
    if policy not in POLICY_NAMES:
        raise ValueError(f"unknown repair policy {policy!r}; choose one of {POLICY_NAMES}")
    if not POLICIES[policy].budgeted:
        raise ValueError(f"{policy} stops at a quality target, not a budget: splice:{policy}")
    if not 0 <= budget_pct <= 100:
        raise ValueError(f"a budget is a percentage in [0, 100], got {budget_pct}")
    return System(f"splice:{policy}@{budget_pct:g}", "radix", policy, float(budget_pct))


def target_system(policy: str) -> System:
    """A splicing system whose policy stops at a quality target rather than a budget."""
    return System(f"splice:{policy}", "radix", policy)


_NAME = re.compile(r"(?:splice:)?(?P<policy>[^@+/]+)(?:@(?P<budget>[^+/]+))?(?P<rest>.*)")


def name_parts(system: str) -> tuple[str, str, str]:
    """A system's name as (policy, budget, suffixes): "splice:attention@15+fallback0.1/plain" is
    ("attention", "15", "+fallback0.1/plain"), "splice:adaptive" ("adaptive", "", ""), "radix" ("radix", "",
    "")."""
    m = _NAME.fullmatch(system)
    assert m is not None, f"not a system name: {system!r}"
    return m["policy"], m["budget"] or "", m["rest"]


def policy_budgets(policy: str, budgets: Sequence[float]) -> list[float]:
    """The budgets at which a policy runs when none is named: none at 0, full at 100, others between."""
    if policy == "none":
        return [0.0]
    if policy == "full":
        return [100.0]
    return sorted({float(b) for b in budgets if 0 < b < 100})


def parse_systems(names: Sequence[str], budgets: Sequence[float] = DEFAULT_BUDGETS) -> list[System]:
    """Systems from names (each may be a comma-separated list), the reference first, no duplicates."""
    systems: dict[str, System] = {}
    for item in (n.strip() for name in names for n in name.split(",")):
        if not item:
            continue
        item, *suffixes = item.split("+")
        knobs = _knobs(item, suffixes)
        if item in PREFIX_SYSTEMS:
            found = [System(item, item)]
        elif item == "splice":
            found = [
                splice_system(p, b) if POLICIES[p].budgeted else target_system(p)
                for p in POLICY_NAMES
                for b in (policy_budgets(p, budgets) if POLICIES[p].budgeted else [0.0])
            ]
        elif item.startswith("splice:"):
            policy, _, budget = item.removeprefix("splice:").partition("@")
            if policy in POLICIES and not POLICIES[policy].budgeted:
                if budget:
                    raise ValueError(f"{policy} stops at a quality target, not a budget: splice:{policy}")
                found = [target_system(policy)]
            elif budget:
                try:
                    pct = float(budget.rstrip("%"))
                except ValueError:
                    raise ValueError(
                        f"bad budget in {item!r}: a percentage, as in splice:deviation@15"
                    ) from None
                found = [splice_system(policy, pct)]
            else:
                if policy not in POLICY_NAMES:
                    raise ValueError(f"unknown repair policy {policy!r}; choose one of {POLICY_NAMES}")
                found = [splice_system(policy, b) for b in policy_budgets(policy, budgets)]
        else:
            raise ValueError(
                f"unknown system {item!r}: use off, hash, radix, splice, splice:<policy> or "
                f"splice:<policy>@<percent> (policies: {', '.join(POLICY_NAMES)})"
            )
        for knob, value in knobs:
            found = [_with(s, knob, value) for s in found]
        for system in found:
            systems.setdefault(system.name, system)
    reference = systems.pop(REFERENCE, System(REFERENCE, REFERENCE))
    return [reference, *systems.values()]


# A splice system's suffixes: +<knob><value>, each a number in [0, 1].
SUFFIXES = ("fallback",)


def _with(system: System, knob: str, value: float) -> System:
    """The system with a suffix's knob set: its own name, so its own cache salt."""
    name = f"{system.name}+{knob}{value:g}"
    assert knob == "fallback"
    return dataclasses.replace(system, name=name, fallback_margin=value)


def _knobs(item: str, suffixes: Sequence[str]) -> list[tuple[str, float]]:
    """The (knob, value) pairs of a system name's "+..." suffixes, checked."""
    knobs: dict[str, float] = {}
    for suffix in suffixes:
        knob = next((k for k in SUFFIXES if suffix.startswith(k)), None)
        if knob is None:
            raise ValueError(
                f"unknown suffix +{suffix} of {item}: use {', '.join(f'+{k}<value>' for k in SUFFIXES)}"
            )
        if not item.startswith("splice"):
            raise ValueError(f"only a splice system takes +{knob}: {item}+{suffix}")
        if knob in knobs:
            raise ValueError(f"+{knob} twice in {item}")
        try:
            value = float(suffix.removeprefix(knob))
        except ValueError:
            raise ValueError(f"bad {knob} in {item}+{suffix}: a number in [0, 1]") from None
        if not 0 <= value <= 1:
            raise ValueError(f"a {knob} is a number in [0, 1], got {value}")
        knobs[knob] = value
    return list(knobs.items())


def default_systems(budgets: Sequence[float] | None = None) -> list[System]:
    return parse_systems(DEFAULT_SYSTEMS, DEFAULT_BUDGETS if budgets is None else budgets)


def prompt_parts(
    system: System, request: BenchRequest, encode: Callable[[str], list[int]] | None = None
) -> list[Part]:
    """The request as the system sends it: documents become Segments on splicing systems that mark
    them; unmarked, the prompt is one string. `encode` turns text into token ids for models without a
    tokenizer."""
    if not system.marked:
        return [encode(request.text) if encode is not None else request.text]
    parts: list[Part] = []
    for part in request.parts:
        text = part.text if isinstance(part, Doc) else part
        content: str | list[int] = encode(text) if encode is not None else text
        parts.append(Segment(content) if isinstance(part, Doc) and system.splices else content)
    return parts


class WordHashEncoder:
    """Text to token ids without a tokenizer (tiny test models): one id per whitespace-separated word,
    by CRC32, below the vocabulary size and above the few ids reserved for special tokens."""

    RESERVED = 4

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, text: str) -> list[int]:
        span = self.vocab_size - self.RESERVED
        return [self.RESERVED + zlib.crc32(word.encode()) % span for word in text.split()]
