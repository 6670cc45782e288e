"""A prefill as data the scheduler can cut into chunks: passes of query positions through layer ranges.

A plain prefill is one pass: the prompt's uncached tokens through every layer. A repair that probes
first (CacheBlend) is two: every candidate through the first layers, then the chosen ones through the
rest, resuming from the hidden states the first pass left. A probe of the question's attention is
three: the computed tokens through the first layers, the chosen reused tokens through the same
layers, then both through the rest. Each pass runs chunk by chunk, in
position order, and chunking does not change the result: a query attends only to keys at or before
its position, so when a pass's chunks run in position order every query reads exactly the keys it
would read if the whole pass ran at once (the earlier chunks have written theirs on every layer of
the pass). Only the floating-point grouping of the matmuls differs. A pass with the segment shift
is cut only between the samples it estimates from (repair/shift.py), so a chunk may hold more than it
was granted: the whole of a sample longer than the grant.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvsplice.kv.context import LayerObserver
from kvsplice.models.runner import ForwardChunk, ForwardResult
from kvsplice.repair.shift import SegmentShift


@dataclass(frozen=True)
class Pass:
    positions: tuple[int, ...]  # sorted, non-empty
    layers: range
    observer: LayerObserver | None = None
    shift: SegmentShift | None = None


class PrefillWork:
    def __init__(
        self,
        block_table: Sequence[int],
        token_ids: Sequence[int],
        first: Pass,
        num_layers: int,
        *,
        need_logits: bool,
        next_pass: Callable[[torch.Tensor | None], Pass | None] = lambda logits: None,
    ) -> None:
        """`next_pass` is asked for the following pass each time one finishes, given the logits [vocab]
        the finished pass left if it ran through the last layer to the last token (else None); None ends
        the prefill. With need_logits, the last pass must run through the last layer and end at the last
        token."""
        self.block_table = block_table
        self.token_ids = token_ids
        self.num_layers = num_layers
        self.need_logits = need_logits
        self._next_pass = next_pass
        self.flops = 0.0
        self._pass: Pass | None = None
        self._done = 0  # queries of the current pass already run
        # Where a chunk of the current pass may end (indices into its positions), if not anywhere.
        self._cuts: list[int] | None = None
        # Hidden states the passes that stopped before the last layer left ([positions, hidden]), the row
        # of each position, and the layer they stopped at (all carried rows are at the same depth).
        self._carry: torch.Tensor | None = None
        self._carry_rows: dict[int, int] = {}
        self._carry_stop = 0
        self._outputs: list[torch.Tensor] = []
        self._start(first)

    @property
    def done(self) -> bool:
        return self._pass is None

    @property
    def remaining(self) -> int:
        """Query tokens left in the current pass (later passes are not known yet)."""
        return 0 if self._pass is None else len(self._pass.positions) - self._done

    def chunk_tokens(self, max_tokens: int) -> int:
        """How many queries next_chunk(max_tokens) gives: at most max_tokens of the current pass, bar a
        segment shift's sample that starts the chunk and is longer (then all of it)."""
        current = self._pass
        assert current is not None and max_tokens > 0
        limit = min(self._done + max_tokens, len(current.positions))
        if self._cuts is None:
            return limit - self._done
        below = bisect_right(self._cuts, limit)
        if below and self._cuts[below - 1] > self._done:
            return self._cuts[below - 1] - self._done
        return self._cuts[bisect_right(self._cuts, self._done)] - self._done

    def next_chunk(self, max_tokens: int) -> ForwardChunk:
        """The next queries of the current pass, as many as chunk_tokens(max_tokens) says."""
        current = self._pass
        assert current is not None
        end = self._done + self.chunk_tokens(max_tokens)
        positions = current.positions[self._done : end]
        hidden = None
        if current.layers.start > 0:
            assert self._carry is not None
            rows = torch.tensor([self._carry_rows[p] for p in positions], device=self._carry.device)
            hidden = self._carry[rows]  # [T, hidden]
        last = end == len(current.positions)
        return ForwardChunk(
            self.block_table,
            positions,
            [self.token_ids[p] for p in positions],
            current.layers,
            hidden,
            need_logits=self.need_logits and last and current.layers.stop == self.num_layers,
            observer=current.observer,
            shift=current.shift,
        )

    def complete(self, chunk: ForwardChunk, result: ForwardResult) -> torch.Tensor | None:
        """Record a chunk the runner ran (the one next_chunk gave). Returns the logits [vocab] of the
        last token once the whole prefill is done and logits were asked for, else None."""
        current = self._pass
        assert current is not None
        assert tuple(chunk.positions) == current.positions[self._done : self._done + len(chunk.positions)]
        self._done += len(chunk.positions)
        self.flops += result.flops
        if result.hidden is not None:
            self._outputs.append(result.hidden)
        if self._done < len(current.positions):
            return None
        if current.layers.stop < self.num_layers:
            self._keep(current, torch.cat(self._outputs))  # [queries of the pass, hidden]
        self._outputs = []
        following = self._next_pass(result.logits)
        if following is not None:
            self._start(following)
            return None
        self._pass = None
        if self.need_logits:
            assert current.layers.stop == self.num_layers and current.positions[-1] == len(self.token_ids) - 1
            assert result.logits is not None
            return result.logits
        return None

    def _keep(self, finished: Pass, hidden: torch.Tensor) -> None:
        """Carry a finished pass's hidden states. Passes that stop at the same layer add to the carry
        (a probe's computed tokens, then the chosen tokens through the probe's layers: the pass after
        them resumes both); a pass that stops elsewhere replaces it."""
        kept = []
        if self._carry is not None and self._carry_stop == finished.layers.stop:
            again = set(finished.positions)
            kept = [p for p in self._carry_rows if p not in again]
        if kept:
            assert self._carry is not None
            old = self._carry[torch.tensor([self._carry_rows[p] for p in kept], device=self._carry.device)]
            hidden = torch.cat([old, hidden])  # [kept + the pass's queries, hidden]
        self._carry = hidden
        self._carry_rows = {p: i for i, p in enumerate([*kept, *finished.positions])}
        self._carry_stop = finished.layers.stop

    def _start(self, p: Pass) -> None:
        assert p.positions and list(p.positions) == sorted(set(p.positions))
        if p.layers.start > 0:
            missing = set(p.positions) - self._carry_rows.keys()
            assert not missing, f"a pass resuming at layer {p.layers.start} needs hidden states it lacks"
            assert self._carry_stop == p.layers.start, "a pass resumes where the carried states stopped"
        self._pass, self._done = p, 0
        self._cuts = None
        if p.shift is not None:
            row = {position: i for i, position in enumerate(p.positions)}
            inside: set[int] = set()
            for first, last in p.shift.whole():
                inside.update(range(row[first] + 1, row[last] + 1))  # ends that would cut the sample
            self._cuts = [end for end in range(1, len(p.positions) + 1) if end not in inside]
