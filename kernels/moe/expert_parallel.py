"""The routed experts split over the ranks of a process group (expert parallelism): `moe_experts` over a share.

Rank r of N holds experts [r * E / N, (r + 1) * E / N) of every MoE layer (its stacks w1/w2/w3 are that range only).
Each (token, chosen expert) pair travels to the rank holding the expert (kernels/moe/exchange.py), is computed there
as the single-device reference computes it (weight * expert(x), one row at a time alike in batch-invariant mode), and
comes back; each token's pairs are then summed in ascending expert id into fp32 zeros, the reference's order, so the
sum is bitwise the single device's. A rank with no tokens calls it with zero rows: it still serves the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from dsl.ops.dense import weight_values
from dsl.ops.moe import invariant_expert, swiglu_expert
from kernels.moe.exchange import ExpertExchange

ExpertFn = Callable[..., torch.Tensor]


class ExpertParallelExperts:
    """`moe_experts` (dsl/ops/moe.py's signature) with the experts split over `group`'s ranks; `invariant` picks the
    batch-invariant expert (`invariant_expert`) over the plain one (`swiglu_expert`)."""

    def __init__(self, group: dist.ProcessGroup | None, invariant: bool) -> None:
        self.exchange = ExpertExchange(group)
        self.expert: ExpertFn = invariant_expert if invariant else swiglu_expert

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor | None = None, s2: torch.Tensor | None = None,
                 s3: torch.Tensor | None = None, *, limit: float) -> torch.Tensor:
        """x [N, D], weights fp32 [N, k], experts int64 [N, k] (global ids); w1/w3 [E / ranks, I, D], w2
        [E / ranks, D, I] (packed or not, with scales s1..s3): this rank's experts. Returns fp32 [N, D]."""
        x = x.float()
        n, k = experts.shape
        route = self.exchange.plan(experts, w1.shape[0])
        order = route.order
        arrived = self.exchange.send(route, [x[order // k], weights.reshape(-1)[order, None].float(),
                                             route.local[order, None]])
        done = self._compute(*arrived, ((w1, s1), (w2, s2), (w3, s3)), limit)
        per_pair = self.exchange.gather(route, done)  # [N * k, D] in pair order
        return sum_in_expert_order(per_pair.view(n, k, x.shape[1]), experts, x)

    def _compute(self, x: torch.Tensor, weight: torch.Tensor, local: torch.Tensor, stored: tuple,
                 limit: float) -> torch.Tensor:
        """weight * expert(x) of each arrived pair (x [M, D], weight [M, 1], local expert id [M, 1]), experts in
        ascending id."""
        local = local[:, 0]
        out = x.new_empty(x.shape)
        for e in torch.unique(local).tolist():
            rows = torch.where(local == e)[0]
            w = [weight_values(m[e], None if s is None else s[e]) for m, s in stored]
            out[rows] = self.expert(x[rows], *w, limit, weight[rows])
        return out


def sum_in_expert_order(per_pair: torch.Tensor, experts: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each token's pair outputs per_pair [N, k, D] added into fp32 zeros in ascending expert id (experts [N, k]),
    the order `dsl.ops.moe._sum_experts` adds them in. Returns [N, D]."""
    y = torch.zeros_like(like)
    if per_pair.shape[1] == 0:
        return y
    ranked = experts.argsort(dim=1)  # [N, k]: slot of the smallest id first
    ordered = per_pair.gather(1, ranked[:, :, None].expand_as(per_pair))
    for j in range(ordered.shape[1]):
        y += ordered[:, j]
    return y


__all__ = ["ExpertParallelExperts", "sum_in_expert_order"]
