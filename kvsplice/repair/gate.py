"""The trust gate: which spliced requests are prefilled in full instead, so that each prompt shape stays
within the quality target a user sets (`EngineConfig.fidelity_target`: the mean first-token KL from a
full prefill, in nats).

A request's risk is read from its own first token after repair: where it leads the runner-up by little
(a near-tie) repair flips answers, where it leads by much it rarely does (docs/fidelity.md). Per prompt
shape the gate keeps samples of (the margin the splice gave, its KL from a full prefill), from audits
(engine/audit.py). From them it picks the lowest margin threshold t such that splicing only the
requests whose margin is at least t, and prefilling the rest in full (KL 0), keeps the shape's mean KL
within the target with two standard errors to spare. Nothing is tuned per model: the threshold is the
answer of the model's own audits on the traffic it serves, and a shape where splicing cannot be trusted
(few-shot prompts on Gemma 3) gets a threshold above every margin, so all its requests fall back.

A shape with fewer than MIN_SAMPLES samples is calibrating: its requests are spliced and every one of
them is audited in the background until the samples are in, so the first requests of a shape are served
as fast as the rest and paid for in background work (counted with it). The gate is plain Python.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.plan import Plan

# Samples a shape needs before its threshold is read from them: fewer give no usable standard error.
MIN_SAMPLES = 10
# Samples kept per shape (the most recent): the threshold follows the traffic as it drifts.
MAX_SAMPLES = 256
# Standard errors between a shape's estimated mean KL and the target.
Z = 2.0


def prompt_shape(plan: Plan) -> str:
    """A prompt's coarse shape: how many reused segments, how long they are on average (tokens), and
    whether marked or found without markup. Few-shot examples and retrieved passages differ in it."""
    spliced = plan.spliced()
    marked = {s.segment for s in spliced if not s.discovered}
    found = {s.segment for s in spliced if s.discovered}
    n = len(marked) + len(found)
    count = "1" if n == 1 else "2-4" if n <= 4 else "5-8" if n <= 8 else "9+"
    mean = sum(len(s) for s in spliced) / max(1, n)
    size = "<128" if mean < 128 else "128-511" if mean < 512 else "512+"
    kind = "marked" if not found else "found" if not marked else "both"
    return f"{count} x {size} {kind}"


@dataclass(frozen=True)
class GateSample:
    """One audited splice: its first token's margin after repair (probability lead over the runner-up)
    and the KL of its first-token distribution from a full prefill's."""

    margin: float
    kl: float


def threshold(samples: Sequence[GateSample], target: float) -> float:
    """The lowest margin t such that splicing the requests with margin >= t (the rest, KL 0, in full)
    keeps the mean KL's upper bound (mean + Z standard errors) within `target`; math.inf where even
    the lowest splicing candidate does not (every request of the shape in full)."""
    n = len(samples)
    assert n >= 2, "a standard error needs two samples"
    for t in sorted({0.0, *(s.margin for s in samples)}):
        kept = [s.kl if s.margin >= t else 0.0 for s in samples]
        mean = sum(kept) / n
        sd = math.sqrt(sum((k - mean) ** 2 for k in kept) / (n - 1))
        if mean + Z * sd / math.sqrt(n) <= target:
            return t
    return math.inf


@dataclass(frozen=True)
class GateCell:
    """A snapshot of one shape, for Engine.stats() and GET /audit."""

    shape: str
    samples: int
    # The margin below which requests fall back to a full prefill (inf: all; None: calibrating).
    threshold: float | None
    kl_mean: float
    fallbacks: int
    fallback_tokens: int


class _Cell:
    def __init__(self) -> None:
        self.samples: deque[GateSample] = deque(maxlen=MAX_SAMPLES)
        self.pending = 0
        self.threshold: float | None = None
        self.fallbacks = 0
        self.fallback_tokens = 0


class TrustGate:
    """Per prompt shape: the samples, the margin threshold read from them, and what falling back cost."""

    def __init__(self, target: float) -> None:
        assert target > 0, "a gate needs a positive target (fidelity_target 0 means no gate)"
        self.target = target
        self._cells: dict[str, _Cell] = {}

    def margin(self, shape: str) -> float:
        """The fallback margin for a request of this shape: 0 (splice) while the shape calibrates."""
        cell = self._cells.get(shape)
        return 0.0 if cell is None or cell.threshold is None else cell.threshold

    def wants_sample(self, shape: str) -> bool:
        """Whether the shape still calibrates, counting the audits already queued for it."""
        cell = self._cells.get(shape)
        return cell is None or len(cell.samples) + cell.pending < MIN_SAMPLES

    def queued(self, shape: str) -> None:
        self._cells.setdefault(shape, _Cell()).pending += 1

    def dropped(self, shape: str) -> None:
        """A queued audit that never ran (no free blocks for it)."""
        cell = self._cells[shape]
        assert cell.pending > 0
        cell.pending -= 1

    def add(self, shape: str, sample: GateSample, *, queued: bool) -> None:
        """A sample, from a queued audit (`queued`) or a free one: a fallback's own full prefill."""
        assert sample.margin >= 0 and sample.kl >= 0
        cell = self._cells.setdefault(shape, _Cell())
        if queued:
            assert cell.pending > 0
            cell.pending -= 1
        cell.samples.append(sample)
        if len(cell.samples) >= MIN_SAMPLES:
            cell.threshold = threshold(cell.samples, self.target)

    def fell_back(self, shape: str, tokens: int) -> None:
        """A request of this shape fell back below the gate's margin, recomputing `tokens` more."""
        cell = self._cells[shape]
        cell.fallbacks += 1
        cell.fallback_tokens += tokens

    def summary(self) -> tuple[GateCell, ...]:
        return tuple(
            GateCell(
                shape,
                len(c.samples),
                c.threshold,
                sum(s.kl for s in c.samples) / len(c.samples) if c.samples else 0.0,
                c.fallbacks,
                c.fallback_tokens,
            )
            for shape, c in sorted(self._cells.items())
        )
