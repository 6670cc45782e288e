"""Margin attribution: how much each cached token's KV moves the answer's lead over its runner-up.

A pass with an attribution reads every earlier key and value of the pool as a tensor that requires
gradients (its own queries' K/V stay differentiable from their hidden states), runs through every
layer, and at the last token takes the margin between the two most likely next tokens in
log-probability. Its gradient with respect to each token's cached K and V, times those K and V and
summed in absolute value over layers, heads and dimensions, is the token's score: to first order,
how much an error of the size of its KV moves the margin. Where a spliced request flips the first
token it is on a near-tie (docs/fidelity.md), so the tokens that decide the margin are the ones a
repair should make exact; the question's attention on one layer (`lead`) weighs every head alike,
whether or not it moves the answer.
"""

from __future__ import annotations

import torch


class MarginAttribution:
    """Collects the KV a pass reads on every layer and, given the pass's last logits, scores it."""

    def __init__(self, length: int, queries: tuple[int, ...]) -> None:
        assert queries and queries[-1] == length - 1, "the margin is the last token's"
        # The positions the attributed pass runs (sorted): their K/V stay differentiable, the rest is read.
        self.queries = queries
        self.score = torch.zeros(length)  # [prompt tokens]
        self._read: list[torch.Tensor] = []
        self.done = False

    def read(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: [S, Hkv, D] a layer's pool KV by position (key index p holds position p);
        positions: [T] the pass's queries; k, v: [T, Hkv, D] their own K/V -> the keys and values to
        attend over (float32), the read ones as gradient leaves, the queries' own in their place."""
        assert not self.done, "an attribution scores one pass"
        read_k = keys.float().requires_grad_()
        read_v = values.float().requires_grad_()
        self._read += [read_k, read_v]
        return (
            torch.index_put(read_k, (positions,), k.float()),
            torch.index_put(read_v, (positions,), v.float()),
        )

    def finish(self, logits: torch.Tensor) -> None:
        """logits: [vocab] of the pass's last token, still attached to the reads."""
        assert self._read and not self.done, "finish follows a pass that read KV"
        logp = logits.log_softmax(-1)
        top = logp.topk(2).indices
        grads = torch.autograd.grad(logp[top[0]] - logp[top[1]], self._read)
        for x, g in zip(self._read, grads, strict=True):
            # [S, Hkv, D] -> [S]: a query's own slot read a value it then replaced, and padding past the
            # sequence is never visible, so their gradients are 0.
            token = (x.detach() * g).abs().sum(dim=(1, 2)).cpu()[: self.score.numel()]
            self.score[: token.numel()] += token
        self._read = []
        self.done = True
