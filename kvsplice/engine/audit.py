"""A live audit of splicing: how far the engine's own traffic is from a full prefill.

A share of the spliced requests (`EngineConfig.audit_ratio`) is also prefilled in full, as background
work (in idle budget, counted with the rest of it), and its first-token distribution is compared with
the one the request was answered from: KL(full || spliced) and whether the most likely first token is
the same. The results are kept per tenant salt and per coarse prompt shape (repair/gate.py: how many
reused segments, how long, marked or found without markup), for /metrics and `GET /audit`. The trust
gate also has every request of a shape it is calibrating audited, and takes each audit as a sample.

Which requests are audited is a deterministic schedule, not a draw: with ratio r the n-th spliced
request is audited where floor(n r) grows, so a run's audits do not depend on a seed. An audit never
evicts cached KV to find room: where the free blocks do not hold the prompt it is dropped (counted).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvsplice.kv.pool import KVPool
from kvsplice.repair.gate import GateSample, TrustGate
from kvsplice.reuse.work import Pass, PrefillWork
from kvsplice.sampling import kl_divergence, top_margin
from kvsplice.tiers.entry import salt_key

# Upper bounds of the KL histogram's buckets (nats); the last is +inf.
KL_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, math.inf)


@dataclass
class AuditCell:
    """The audits of one (salt, shape)."""

    requests: int = 0
    agreements: int = 0
    kl_sum: float = 0.0
    # Audits whose KL is at most each of KL_BUCKETS (cumulative, as Prometheus wants).
    kl_buckets: list[int] = field(default_factory=lambda: [0] * len(KL_BUCKETS))

    def add(self, kl: float, agrees: bool) -> None:
        self.requests += 1
        self.agreements += agrees
        self.kl_sum += kl
        for i, bound in enumerate(KL_BUCKETS):
            self.kl_buckets[i] += kl <= bound


@dataclass(frozen=True)
class AuditSummary:
    """A snapshot of one cell, for Engine.stats()."""

    salt: str
    shape: str
    requests: int
    agreements: int
    kl_sum: float
    kl_buckets: tuple[int, ...]

    @property
    def first_token_agreement(self) -> float:
        return self.agreements / self.requests

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.requests


class AuditSchedule:
    """Which spliced requests are audited: the n-th where floor(n * ratio) grows."""

    def __init__(self, ratio: float) -> None:
        assert 0.0 <= ratio <= 1.0
        self.ratio = ratio
        self._seen = 0

    def pick(self) -> bool:
        self._seen += 1
        return math.floor(self._seen * self.ratio) > math.floor((self._seen - 1) * self.ratio)


class Audits:
    """The audit results so far, by (salt, shape)."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], AuditCell] = {}
        self.dropped = 0

    def record(self, salt: str, prompt_shape: str, kl: float, agrees: bool) -> None:
        self.cells.setdefault((salt, prompt_shape), AuditCell()).add(kl, agrees)

    def summary(self) -> tuple[AuditSummary, ...]:
        return tuple(
            AuditSummary(salt, s, c.requests, c.agreements, c.kl_sum, tuple(c.kl_buckets))
            for (salt, s), c in sorted(self.cells.items())
        )


class AuditFill:
    """One audit as background work: the prompt prefilled in full in blocks of its own, then compared
    with the logits [vocab] the request was answered from. With a trust gate, the comparison is also
    one of its samples (repair/gate.py)."""

    def __init__(
        self,
        pool: KVPool,
        num_layers: int,
        audits: Audits,
        namespace: Hashable,
        token_ids: Sequence[int],
        spliced_logits: torch.Tensor,
        prompt_shape: str,
        gate: TrustGate | None = None,
        gate_key: str = "",
        gate_logits: torch.Tensor | None = None,
    ) -> None:
        """gate_key: the request's cell in the gate; gate_logits: the logits [vocab] repair gave before a
        fallback, which the gate samples (None: the request was answered from them, `spliced_logits`)."""
        self.pool = pool
        self.num_layers = num_layers
        self.audits = audits
        self.salt = salt_key(namespace)
        self.token_ids = tuple(token_ids)
        self.spliced_logits = spliced_logits
        self.shape = prompt_shape
        self.gate = gate
        self.gate_key = gate_key
        self.gate_logits = spliced_logits if gate_logits is None else gate_logits
        self._blocks: list[int] = []
        if gate is not None:
            gate.queued(gate_key)

    def start(self) -> PrefillWork | None:
        """The full prefill's work; None (the audit dropped) when the free blocks do not hold it."""
        needed = -(-len(self.token_ids) // self.pool.block_size)
        if self.pool.allocator.num_free < needed:
            self.audits.dropped += 1
            if self.gate is not None:
                self.gate.dropped(self.gate_key)
            return None
        self._blocks = self.pool.allocator.allocate(needed)
        positions = tuple(range(len(self.token_ids)))
        return PrefillWork(
            self._blocks,
            self.token_ids,
            Pass(positions, range(self.num_layers)),
            self.num_layers,
            need_logits=True,
        )

    def finish(self, logits: torch.Tensor | None) -> None:
        assert logits is not None, "a full prefill through every layer gives the last token's logits"
        kl = kl_divergence(logits, self.spliced_logits)
        agrees = int(logits.argmax()) == int(self.spliced_logits.argmax())
        self.audits.record(self.salt, self.shape, kl, agrees)
        if self.gate is not None:
            sample = GateSample(top_margin(self.gate_logits), kl_divergence(logits, self.gate_logits))
            self.gate.add(self.gate_key, sample, queued=True)
        self.pool.allocator.decref(reversed(self._blocks))
        self._blocks = []
