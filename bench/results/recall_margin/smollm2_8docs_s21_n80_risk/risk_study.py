"""Scratch study (numbers in ../README.md): does margin's probe tell which first tokens will flip?

`risk_study.py probe bench recall ... --out DIR` runs the bench with the margin policy patched to log,
per choice, the prompt length, the attribution's total score over the stale tokens and its residual
(over those not chosen), and the unrepaired logits' top token and margins, to DIR.risk.jsonl (moved
into DIR as risk.jsonl afterwards).
`risk_study.py replay DIR` ranks the margin system's requests by each signal (riskiest first) and
prints how many of its first-token flips the k riskiest hold: a fallback gate's replay.
"""

import json
import sys
from collections.abc import Callable
from typing import Any

SYSTEM = "splice:margin@15"


def probe(argv: list[str]) -> int:
    import kvsplice.repair.margin as margin
    from kvsplice import cli

    out = argv[argv.index("--out") + 1]
    original = margin.MarginRepair.choose
    with open(f"{out}.risk.jsonl", "w") as log:

        def choose(self, task, probe, logits):  # type: ignore[no-untyped-def]
            chosen = original(self, task, probe, logits)
            if probe.attribution is not None:
                score, stale = probe.attribution.score, task.plan.stale()
                rest = sorted(set(stale) - set(chosen))
                top = logits.double().softmax(-1).topk(2)
                logp = logits.double().log_softmax(-1)
                row = {
                    "tokens": task.plan.num_tokens,
                    "chosen": len(chosen),
                    "budget": task.budget,
                    "total": float(score[stale].sum()),
                    "residual": float(score[rest].sum()) if rest else 0.0,
                    "top": int(top.indices[0]),
                    "pmargin": float(top.values[0] - top.values[1]),
                    "lmargin": float(logp[top.indices[0]] - logp[top.indices[1]]),
                }
                log.write(json.dumps(row) + "\n")
                log.flush()
            return chosen

        margin.MarginRepair.choose = choose  # type: ignore[method-assign]
        return cli.main(argv)


def replay(directory: str) -> None:
    with open(directory + "/risk.jsonl") as f:
        risk = [json.loads(line) for line in f]
    with open(directory + "/results.json") as f:
        records = json.load(f)["records"]
    spliced = [r for r in records if r["system"] == SYSTEM]
    # The policy logged its choices in request order (warm-ups too, and only requests with stale
    # tokens): match them to the records by prompt length.
    rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
    logged = iter(risk)
    current = next(logged, None)
    for record in spliced:
        if current is not None and current["tokens"] == record["prompt_tokens"]:
            if not record["warmup"]:
                rows.append((record, current))
            current = next(logged, None)
    flips = [row for row in rows if not row[0]["top1"]]
    print(f"{len(rows)} requests, {len(flips)} first-token flips; flips among the k riskiest:")

    def show(name: str, key: Callable[[tuple[dict[str, Any], dict[str, Any]]], Any]) -> None:
        ranked = sorted(rows, key=key)
        caught = " ".join(f"{k}:{sum(not r[0]['top1'] for r in ranked[:k])}" for k in (5, 10, 20, 30, 40))
        print(f"  {name:36s} {caught}")

    show("own margin (after repair)", lambda x: x[0]["margin"])
    show("unrepaired margin", lambda x: x[1]["pmargin"])
    show("own margin / residual score", lambda x: x[0]["margin"] / max(x[1]["residual"], 1e-9))
    show("own margin / total score", lambda x: x[0]["margin"] / max(x[1]["total"], 1e-9))
    show("unrepaired log margin / residual", lambda x: x[1]["lmargin"] / max(x[1]["residual"], 1e-9))
    show("residual score (largest first)", lambda x: -x[1]["residual"])
    show("repair changed the top token", lambda x: (x[0]["token_ids"][0] == x[1]["top"], x[0]["margin"]))
    for record, logged_row in sorted(flips, key=lambda x: x[0]["margin"]):
        print(
            f"  flip: own margin {record['margin']:.3f}, full's {record['reference_margin']:.3f}, "
            f"unrepaired {logged_row['pmargin']:.3f}, KL {record['kl']:.3f}"
        )


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        sys.exit(probe(sys.argv[2:]))
    replay(sys.argv[2])
