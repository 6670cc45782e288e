"""A live audit of splicing: how far the engine's own traffic is from a full prefill.

A share of the spliced requests (`EngineConfig.audit_ratio`) is also prefilled in full, as background
work (in idle budget, counted with the rest of it), and its first-token distribution is compared with
the one the request was answered from: KL(full || spliced) and whether the most likely first token is
the same; for a greedy request, also how many leading tokens of its answer (up to CONTINUATION) the full
prefill's greedy decoding gives too. The results are kept per tenant salt and per coarse prompt shape
(repair/gate.py: how many reused segments, how long, marked or found without markup), for /metrics and
`GET /audit`. The trust gate also has every request of a cell it calibrates audited, and takes each
audit as a sample. A request may ask for its own audit (`RequestOptions.audit`): it runs before the
request returns, and its result is in the request's metrics (the server's `usage`).

An audit runs once the request has finished, so that its answer is known. Which requests are audited
is a deterministic schedule, not a draw: with ratio r the n-th spliced request is audited where
floor(n r) grows, so a run's audits do not depend on a seed. An audit never evicts cached KV to find
room: where the free blocks do not hold the prompt it is dropped (counted).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from kvsplice.models.runner import DecodeItem, ModelRunner
from kvsplice.repair.gate import GateSample, TrustGate
from kvsplice.reuse.work import Pass, PrefillWork
from kvsplice.sampling import kl_divergence, top_margin
from kvsplice.tiers.entry import salt_key

# Upper bounds of the KL histogram's buckets (nats); the last is +inf.
KL_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1.0, math.inf)
# Leading tokens of a greedy answer compared with the full prefill's greedy decoding (the bench's too).
CONTINUATION = 16


@dataclass(frozen=True)
class AuditResult:
    """One audited request."""

    first_token_kl: float
    first_token_agrees: bool
    # Leading answered tokens (at most CONTINUATION) the full prefill's greedy decoding gives too, and
    # how many were compared (None: the request sampled, so its answer is not a greedy decoding).
    agreeing_tokens: int | None
    compared_tokens: int | None


@dataclass
class AuditCell:
    """The audits of one (salt, shape)."""

    requests: int = 0
    agreements: int = 0
    kl_sum: float = 0.0
    # Audits whose KL is at most each of KL_BUCKETS (cumulative, as Prometheus wants).
    kl_buckets: list[int] = field(default_factory=lambda: [0] * len(KL_BUCKETS))
    # Greedy audits: how many, their agreeing leading tokens, and those whose compared tokens all agree.
    continuations: int = 0
    agreeing_tokens: int = 0
    same_continuations: int = 0

    def add(self, result: AuditResult) -> None:
        self.requests += 1
        self.agreements += result.first_token_agrees
        self.kl_sum += result.first_token_kl
        for i, bound in enumerate(KL_BUCKETS):
            self.kl_buckets[i] += result.first_token_kl <= bound
        if result.agreeing_tokens is not None:
            self.continuations += 1
            self.agreeing_tokens += result.agreeing_tokens
            self.same_continuations += result.agreeing_tokens == result.compared_tokens


@dataclass(frozen=True)
class AuditSummary:
    """A snapshot of one cell, for Engine.stats()."""

    salt: str
    shape: str
    requests: int
    agreements: int
    kl_sum: float
    kl_buckets: tuple[int, ...]
    continuations: int
    agreeing_tokens: int
    same_continuations: int

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

    def record(self, salt: str, prompt_shape: str, result: AuditResult) -> None:
        self.cells.setdefault((salt, prompt_shape), AuditCell()).add(result)

    def summary(self) -> tuple[AuditSummary, ...]:
        return tuple(
            AuditSummary(
                salt,
                s,
                c.requests,
                c.agreements,
                c.kl_sum,
                tuple(c.kl_buckets),
                c.continuations,
                c.agreeing_tokens,
                c.same_continuations,
            )
            for (salt, s), c in sorted(self.cells.items())
        )


def answered(output_ids: Sequence[int], greedy: bool) -> tuple[int, ...] | None:
    """The leading answered tokens an audit compares (None: a sampled answer, not compared)."""
    return tuple(output_ids[:CONTINUATION]) if greedy else None


class AuditFill:
    """One audit as background work (or run at once, for a request that asked): the prompt prefilled
    in full in blocks of its own and compared with the logits [vocab] the request was answered from,
    then the answer's tokens decoded over that KV while the full prefill's greedy choice agrees. With a
    trust gate, the first-token comparison is also one of its samples (repair/gate.py)."""

    def __init__(
        self,
        runner: ModelRunner,
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
        self.runner = runner
        self.pool = runner.pool
        self.audits = audits
        self.salt = salt_key(namespace)
        self.token_ids = tuple(token_ids)
        self.spliced_logits = spliced_logits
        self.shape = prompt_shape
        self.gate = gate
        self.gate_key = gate_key
        self.gate_logits = spliced_logits if gate_logits is None else gate_logits
        # The answer's leading tokens, once the request finished (`answered`); None: not compared.
        self.answer: tuple[int, ...] | None = None
        self.result: AuditResult | None = None
        # Tokens and FLOPs of the answer's decoding (the prefill's are the runner's chunks).
        self.decoded_tokens = 0
        self.decoded_flops = 0.0
        self._blocks: list[int] = []
        if gate is not None:
            gate.queued(gate_key)

    def abandon(self) -> None:
        """Never run: the request was aborted, or the free blocks did not hold it."""
        if self.gate is not None:
            self.gate.dropped(self.gate_key)

    def start(self) -> PrefillWork | None:
        """The full prefill's work, in blocks that also hold the answer's decoding; None (the audit
        dropped) when the free blocks do not hold them."""
        answer = len(self.answer) if self.answer else 1
        needed = -(-(len(self.token_ids) + answer - 1) // self.pool.block_size)
        if self.pool.allocator.num_free < needed:
            self.audits.dropped += 1
            self.abandon()
            return None
        self._blocks = self.pool.allocator.allocate(needed)
        positions = tuple(range(len(self.token_ids)))
        return PrefillWork(
            self._blocks,
            self.token_ids,
            Pass(positions, range(self.runner.num_layers)),
            self.runner.num_layers,
            need_logits=True,
        )

    def finish(self, logits: torch.Tensor | None) -> None:
        assert logits is not None, "a full prefill through every layer gives the last token's logits"
        kl = kl_divergence(logits, self.spliced_logits)
        agrees = int(logits.argmax()) == int(self.spliced_logits.argmax())
        agreeing = None if self.answer is None else self._agreeing(logits, self.answer)
        compared = None if self.answer is None else len(self.answer)
        self.result = AuditResult(kl, agrees, agreeing, compared)
        self.audits.record(self.salt, self.shape, self.result)
        if self.gate is not None:
            sample = GateSample(top_margin(self.gate_logits), kl_divergence(logits, self.gate_logits))
            self.gate.add(self.gate_key, sample, queued=True)
        self.pool.allocator.decref(reversed(self._blocks))
        self._blocks = []

    def _agreeing(self, logits: torch.Tensor, answer: tuple[int, ...]) -> int:
        """How many leading answer tokens the full prefill's greedy decoding gives: decoded one by one
        over the audit's KV while they agree (up to a divergence, greedy decoding and the answer fed
        back are the same sequence)."""
        n = len(self.token_ids)
        for i, token in enumerate(answer):
            if int(logits.argmax()) != token:
                return i
            if i + 1 < len(answer):
                result = self.runner.decode([DecodeItem(self._blocks, token, n + i)])
                assert result.logits is not None
                logits = result.logits[0]
                self.decoded_tokens += 1
                self.decoded_flops += result.flops
        return len(answer)
