"""The trust gate: which spliced requests are prefilled in full instead, so that each prompt shape stays
within the quality target a user sets (`EngineConfig.fidelity_target`: the mean first-token KL from a
full prefill, in nats).

A request's risk is read from its own first token after repair: where it leads the runner-up by little
(a near-tie) repair flips answers, where it leads by much it rarely does (docs/fidelity.md). Per cell (a
prompt shape under one repair policy and budget) the gate keeps samples of (the margin the splice gave,
its KL from a full prefill), from audits (engine/audit.py). From them it picks the lowest margin
threshold t such that splicing only the requests whose margin is at least t, and prefilling the rest in
full (KL 0), keeps the cell's mean KL within the target with Z standard errors to spare. Nothing is
tuned per model: the threshold is the answer of the model's own audits on the traffic it serves, and a
cell where splicing cannot be trusted gets a threshold above every margin: all its requests fall back.

A cell calibrates until it has MIN_SAMPLES samples of requests it splices: every request is audited
meanwhile (a spliced one in the background, counted with the rest of that work; one that fell back is
its own full prefill, a free sample), so every request is a sample and the samples stay a fair draw of
the cell's traffic. Its first requests are spliced (no threshold before MIN_SAMPLES samples), served
as fast as the rest. With tiers below the pool the samples are kept there, beside the stored segments
(engine/gate_sync.py): a restarted engine does not calibrate again, and replicas that share a Redis
share their samples, so a shape calibrates once, not once per replica. Each sample carries where and
when it was taken (`to_bytes`, `merge`), so merging what another replica wrote never counts a sample
twice. The gate is plain Python.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvsplice.plan import Plan

log = logging.getLogger(__name__)

# Samples a cell needs before its threshold is read from them: fewer give no usable standard error.
MIN_SAMPLES = 10
# Samples kept per cell (the most recent): the threshold follows the traffic as it drifts.
MAX_SAMPLES = 256
# Standard errors between a cell's estimated mean KL and the target.
Z = 2.0


def prompt_shape(plan: Plan, inherited: int = 0) -> str:
    """A prompt's coarse shape: how many reused segments, how long they are on average (tokens), and
    whether marked or found without markup. Few-shot examples and retrieved passages differ in it. A
    prompt that splices nothing but extends an earlier request's spliced KV (`inherited` tokens of it,
    a chat turn's history) is an "inherited prefix"; one that does both has the shape of what it
    splices (a cell of its own would cost another calibration, and in chat such turns were as close
    as other splices of their shape: docs/design.md). "" where nothing is reused but exact KV."""
    spliced = plan.spliced()
    if not spliced:
        return "inherited prefix" if inherited else ""
    marked = {s.segment for s in spliced if not s.discovered}
    found = {s.segment for s in spliced if s.discovered}
    n = len(marked) + len(found)
    count = "1" if n == 1 else "2-4" if n <= 4 else "5-8" if n <= 8 else "9+"
    mean = sum(len(s) for s in spliced) / max(1, n)
    size = "<128" if mean < 128 else "128-511" if mean < 512 else "512+"
    kind = "marked" if not found else "found" if not marked else "both"
    return f"{count} x {size} {kind}"


def gate_cell(shape: str, policy: str, ratio: float) -> str:
    """The gate's cell: a prompt shape under one repair (its KL depends on both)."""
    return f"{shape}, {policy}@{ratio * 100:g}%"


@dataclass(frozen=True)
class GateSample:
    """One audited splice: its first token's margin after repair (probability lead over the runner-up)
    and the KL of its first-token distribution from a full prefill's."""

    margin: float
    kl: float


def threshold(samples: Sequence[GateSample], target: float) -> float:
    """The lowest margin t such that splicing the requests with margin >= t (the rest, KL 0, in full)
    keeps the mean KL's upper bound (mean + Z standard errors) within `target`; math.inf where even
    the lowest splicing candidate does not (every request of the cell in full)."""
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
    """A snapshot of one cell (a prompt shape under one repair), for Engine.stats() and GET /audit."""

    key: str
    samples: int
    # The margin below which requests fall back to a full prefill (inf: all; None: calibrating).
    threshold: float | None
    kl_mean: float
    fallbacks: int
    fallback_tokens: int


class _Cell:
    def __init__(self) -> None:
        self.samples: deque[GateSample] = deque(maxlen=MAX_SAMPLES)
        # Per sample, where and when it was taken: (nanoseconds, the gate that took it).
        self.ids: deque[tuple[int, int]] = deque(maxlen=MAX_SAMPLES)
        self.pending = 0
        self.threshold: float | None = None
        self.fallbacks = 0
        self.fallback_tokens = 0


@dataclass(frozen=True)
class Merged:
    """What `TrustGate.merge` did: samples it took, and samples of its own the data lacked."""

    taken: int
    missing: int


class TrustGate:
    """Per cell (a prompt shape under one repair): the samples, the margin threshold read from them,
    and what falling back cost."""

    def __init__(self, target: float) -> None:
        assert target > 0, "a gate needs a positive target (fidelity_target 0 means no gate)"
        self.target = target
        self._cells: dict[str, _Cell] = {}
        # Names this gate's samples among other replicas' (random: replicas share no counter).
        self.origin = secrets.randbits(62)
        self._last_stamp = 0
        # Samples this gate took itself, so far.
        self.taken = 0

    def margin(self, key: str) -> float:
        """The fallback margin for a request of this cell: 0 (splice) while the cell calibrates."""
        c = self._cells.get(key)
        return 0.0 if c is None or c.threshold is None else c.threshold

    def wants_sample(self, key: str) -> bool:
        """Whether the cell still calibrates: until MIN_SAMPLES of its samples (the audits queued for it
        counted) are of requests it splices, those at or above its threshold. Where it splices all, that
        is its first MIN_SAMPLES requests; where it falls back on some, the mean KL of the rest rests on
        those it splices, so it samples on (its fallbacks are free samples); where it falls back on all,
        every request is a free sample, and the cell can learn that it may splice again."""
        c = self._cells.get(key)
        if c is None:
            return True
        t = 0.0 if c.threshold is None else c.threshold
        return sum(s.margin >= t for s in c.samples) + c.pending < MIN_SAMPLES

    def queued(self, key: str) -> None:
        self._cells.setdefault(key, _Cell()).pending += 1

    def dropped(self, key: str) -> None:
        """A queued audit that never ran (no free blocks for it)."""
        c = self._cells[key]
        assert c.pending > 0
        c.pending -= 1

    def add(self, key: str, sample: GateSample, *, queued: bool) -> None:
        """A sample, from a queued audit (`queued`) or a free one: a fallback's own full prefill."""
        assert sample.margin >= 0 and sample.kl >= 0
        c = self._cells.setdefault(key, _Cell())
        if queued:
            assert c.pending > 0
            c.pending -= 1
        # Nanoseconds, strictly increasing: two samples of one gate never share an id.
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        c.samples.append(sample)
        c.ids.append((self._last_stamp, self.origin))
        self.taken += 1
        self._refresh(c)

    def fell_back(self, key: str, tokens: int) -> None:
        """A request of this cell fell back below the gate's margin, recomputing `tokens` more."""
        c = self._cells[key]
        c.fallbacks += 1
        c.fallback_tokens += tokens

    def summary(self) -> tuple[GateCell, ...]:
        return tuple(
            GateCell(
                key,
                len(c.samples),
                c.threshold,
                sum(s.kl for s in c.samples) / len(c.samples) if c.samples else 0.0,
                c.fallbacks,
                c.fallback_tokens,
            )
            for key, c in sorted(self._cells.items())
        )

    def to_bytes(self) -> bytes:
        """Every cell's samples, with where and when each was taken (what `merge` reads)."""
        cells = {
            key: [
                [s.margin, s.kl, stamp, origin] for s, (stamp, origin) in zip(c.samples, c.ids, strict=True)
            ]
            for key, c in self._cells.items()
            if c.samples
        }
        return json.dumps({"version": 2, "cells": cells}).encode()

    def merge(self, data: bytes) -> Merged:
        """Take the samples in `data` (another gate's `to_bytes`, or this one's earlier) that this gate
        lacks; per cell the MAX_SAMPLES most recent are kept. Data that cannot be read is logged and
        ignored, never trusted in part."""
        try:
            raw = json.loads(data)
            assert raw["version"] == 2
            cells = {
                str(key): [
                    (GateSample(float(m), float(k)), (int(stamp), int(origin)))
                    for m, k, stamp, origin in rows
                ]
                for key, rows in raw["cells"].items()
            }
            assert all(s.margin >= 0 and s.kl >= 0 for rows in cells.values() for s, _ in rows)
        except (ValueError, KeyError, TypeError, AssertionError) as e:
            log.warning("trust gate samples not used (%s): they are not the gate's", e)
            return Merged(0, 0)
        taken = 0
        for key, rows in cells.items():
            c = self._cells.setdefault(key, _Cell())
            have = set(c.ids)
            new = [(i, s) for s, i in rows if i not in have]
            if not new:
                continue
            taken += len(new)
            # One threshold per cell, from all its samples (not one per sample: O(n^2) each).
            kept = sorted([*zip(c.ids, c.samples, strict=True), *dict(new).items()])[-MAX_SAMPLES:]
            c.ids = deque((i for i, _ in kept), maxlen=MAX_SAMPLES)
            c.samples = deque((s for _, s in kept), maxlen=MAX_SAMPLES)
            self._refresh(c)
        theirs = {i for rows in cells.values() for _, i in rows}
        mine = {i for c in self._cells.values() for i in c.ids}
        return Merged(taken, len(mine - theirs))

    def _refresh(self, c: _Cell) -> None:
        """The cell's threshold, once it has MIN_SAMPLES samples."""
        if len(c.samples) >= MIN_SAMPLES:
            c.threshold = threshold(c.samples, self.target)
