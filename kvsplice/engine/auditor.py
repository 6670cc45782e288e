"""Which requests are audited, and when (engine/audit.py says what an audit is).

Once a request's prefill is done (`prefilled`), it is audited where its KV is not all a full prefill's
(spliced, or a prefix inherited under segment keys) and the audit schedule picks it, the trust gate
still calibrates its cell (repair/gate.py), or it asked (`RequestOptions.audit`). The audit runs when
the request finishes (`finished`), its answer known: a full prefill of its prompt as background work
(at once where the request asked), or none where the request fell back, since its fallback pass was
that full prefill. The gate samples the logits repair gave before any fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvsplice.engine.audit import AuditFill, AuditResult, Audits, AuditSchedule, answered
from kvsplice.models.runner import ModelRunner
from kvsplice.repair.gate import GateSample, TrustGate
from kvsplice.repair.registry import POLICIES
from kvsplice.sampling import kl_divergence, top_margin
from kvsplice.tiers.entry import salt_key

if TYPE_CHECKING:
    from kvsplice.engine.background import BackgroundWork
    from kvsplice.engine.request import Request


class Auditor:
    def __init__(
        self, runner: ModelRunner, background: BackgroundWork, gate: TrustGate | None, ratio: float
    ) -> None:
        self.runner = runner
        self.background = background
        self.gate = gate
        self.audits = Audits()
        self.schedule = AuditSchedule(ratio)

    def prefilled(self, request: Request, logits: torch.Tensor) -> None:
        """Decide the request's audit from its prefill and first-token logits [vocab]."""
        prefill = request.prefill
        assert prefill is not None
        exact_prefix = not prefill.approximate_prefix
        # Spliced, or an earlier request's spliced KV inherited into its own blocks (prefill.shape says).
        reused = bool(prefill.shape) and not POLICIES[request.repair.policy].exact
        if not reused and exact_prefix:
            request.audit = "exact" if request.audit_asked else None
            return
        # The gate judges what it can send to a full prefill: not a prefix left in shared blocks.
        gate = self.gate if reused else None
        repair, key = prefill.repair, prefill.gate_key
        if gate is not None and repair.fell_back and prefill.gate_margin > request.repair.fallback_margin:
            gate.fell_back(key, repair.fallback_tokens)
        calibrating = gate is not None and gate.wants_sample(key)
        if not self.schedule.pick() and not calibrating and not request.audit_asked:
            return
        if repair.fell_back and exact_prefix:
            if gate is not None:
                before = repair.spliced_logits
                assert before is not None
                gate.add(key, GateSample(top_margin(before), kl_divergence(logits, before)), queued=False)
            request.audit = "exact"
            return
        request.audit = AuditFill(
            self.runner,
            self.audits,
            request.namespace,
            request.prompt.token_ids,
            logits.clone(),
            prefill.shape or "inherited prefix",
            gate,
            key,
            repair.spliced_logits,
        )

    def finished(self, request: Request) -> None:
        """Run or queue a finished request's audit, now that its answer is known; one the request asked
        for runs at once, into its metrics."""
        audit, request.audit = request.audit, None
        if audit is None:
            return
        if request.finish_reason == "abort":
            if isinstance(audit, AuditFill):
                audit.abandon()
            return
        answer = answered(request.output_ids, request.params.greedy)
        if isinstance(audit, AuditFill):
            audit.answer = answer
            if not request.audit_asked:
                self.background.audit(audit)
                return
            self.background.audit_now(audit)
            request.metrics.audit = audit.result
            return
        compared = None if answer is None else len(answer)
        # The answer was a full prefill's (and its greedy decoding over exact KV): nothing to compute.
        result = AuditResult(0.0, True, compared, compared)
        assert request.prefill is not None
        if request.prefill.shape:
            self.audits.record(salt_key(request.namespace), request.prefill.shape, result)
        if request.audit_asked:
            request.metrics.audit = result
