"""Scratch study (numbers in ../README.md): `mix`, margin's attribution for half the budget and lead's
question attention (read in margin's attributed pass) for the rest.

usage: mix_study.py bench recall ... --systems off splice:lead@15 splice:mix@15
"""

import sys

import torch

import kvsplice.bench.systems as systems
import kvsplice.config as config
import kvsplice.options as options
import kvsplice.repair.registry as registry
import kvsplice.reuse.repair_run as repair_run
from kvsplice import cli
from kvsplice.repair.margin import MarginRepair
from kvsplice.repair.query import QueryAttentionObserver, lead_choice, most_attended, probe_layers
from kvsplice.reuse.work import Pass


class MixRepair(MarginRepair):
    name = "mix"

    def decide(self, task):
        decision = super().decide(task)
        probe = decision.probe
        if probe is not None and probe.attribution is not None:
            cfg = task.model
            observer = QueryAttentionObserver(
                task.plan.question(), probe_layers(cfg), task.plan.num_tokens, cfg.attn_scale
            )
            object.__setattr__(probe, "observer", observer)
        return decision

    def choose(self, task, probe, logits):
        if probe.attribution is None:
            return super().choose(task, probe, logits)
        assert float(probe.observer.score.sum()) > 0, "the attributed pass watched the question"
        first = lead_choice(task.plan, probe.attribution.score, self._budget // 2)
        score = probe.observer.score.clone()
        score[list(first)] = float("-inf")
        rest = most_attended(task.plan, score, self._budget - len(first))
        return tuple(sorted(set(first) | set(rest)))


def attributed(self, probe):
    return Pass(
        probe.attribution.queries, range(self.task.num_layers), probe.observer, attribution=probe.attribution
    )


_observe = QueryAttentionObserver.observe


def observe(self, layer, ctx, q, k, v):
    with torch.no_grad():
        _observe(self, layer, ctx, q.detach(), k.detach(), v.detach())


QueryAttentionObserver.observe = observe
repair_run.RepairRun._attributed = attributed
registry.POLICIES["mix"] = MixRepair
names = (*registry.POLICY_NAMES, "mix")
for module in (registry, systems, config, options):
    module.POLICY_NAMES = names
sys.exit(cli.main(sys.argv[1:]))
