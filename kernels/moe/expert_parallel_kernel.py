"""The plan's MoE kernel (kernels/moe/experts.py) with the routed experts split over ranks (expert parallelism).

Each rank holds a contiguous 1 / N of every layer's experts (stacks w1/w2/w3 of those only). A forward's (token,
slot) pairs go to the ranks holding their experts (kernels/moe/exchange.py) as the rows GEMM 1 reads (`gemm_rows`:
bf16 for fp4 weights, as the kernel reads them), with their route weights and their experts' local ids; the owner
runs the two grouped GEMMs over its own experts on the pairs that arrived (one pair a row, k = 1) and sends back
each pair's GEMM 2 partials; the origin puts them at their pairs' places and sums each token's k pairs with the
single-device sum (`moe_sum_kernel`: slot order, and split order within a slot). A pair's products depend only on its
row, its expert and the config, not on the other pairs of its block, so with one config on every rank (the plan's
batch-invariant one) every token's output is bitwise the single device's. Outside batch-invariant mode each owner
picks the config of the pairs it received, and sums the splits of each pair before sending it back (the splits'
count is then one on the wire, whatever config each owner chose).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.moe.exchange import ExpertExchange
from kernels.moe.experts import _check, gemm_rows, pair_outputs, sum_pairs

ConfigFor = Callable[[int], dict]  # a count of (token, expert) pairs -> the MoE kernel's config for them


class ParallelMoeKernel:
    """`moe_experts` of kernels/moe/experts.py over this rank's share of the experts, through `exchange`."""

    def __init__(self, exchange: ExpertExchange) -> None:
        self.exchange = exchange

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                 w2: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor | None, s2: torch.Tensor | None,
                 s3: torch.Tensor | None, *, limit: float, config_for: ConfigFor, invariant: bool,
                 dot_fp32: bool = False) -> torch.Tensor:
        """x [N, D] (N may be 0: this rank serves the others), weights fp32 [N, k], experts int [N, k] global ids;
        w1..s3 this rank's experts, as `moe_experts` takes them. `config_for(p)`: the config for p pairs (with
        `invariant`, the one batch-invariant config whatever p). Returns fp32 [N, D]."""
        fp4 = _check(x, weights, experts, [w1, w2, w3], [s1, s2, s3])
        n, k = experts.shape
        route = self.exchange.plan(experts, w1.shape[0])
        rows = gemm_rows(x, fp4, dot_fp32)
        order = route.order
        pair_weights = weights.reshape(-1)[order, None]
        xs, ws, local = self.exchange.send(route, [rows[order // k], pair_weights, route.local[order, None]])
        done = serve_pairs(xs, ws, local, w1, w2, w3, s1, s2, s3, limit=limit, config=config_for(xs.shape[0]),
                           invariant=invariant, dot_fp32=dot_fp32)
        splits, d = wire_splits(config_for(n * k), invariant), x.shape[1]
        back = self.exchange.gather(route, done.reshape(done.shape[0], splits * d))  # [N * k, splits * D]
        return sum_pairs(back.view(n * k, splits, d), k)


def serve_pairs(xs: torch.Tensor, ws: torch.Tensor, local: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, s1: torch.Tensor | None, s2: torch.Tensor | None, s3: torch.Tensor | None, *,
                limit: float, config: dict, invariant: bool, dot_fp32: bool) -> torch.Tensor:
    """The arrived pairs (GEMM 1's rows xs [M, D'], route weights ws fp32 [M, 1], local expert ids [M, 1]) through this
    rank's experts: GEMM 2's partials fp32 [M, splits, D], the splits summed into one outside `invariant`."""
    y = pair_outputs(xs, ws, local, w1, w2, w3, s1, s2, s3, limit=limit, config=config, dot_fp32=dot_fp32)
    return y if invariant else sum_pairs(y, 1)[:, None]


def wire_splits(config: dict, invariant: bool) -> int:
    """How many GEMM 2 partials a pair's result carries back: the config's split count in batch-invariant mode (one
    config on every rank), else one."""
    return config["down"]["split_k"] if invariant else 1


__all__ = ["ConfigFor", "ParallelMoeKernel", "serve_pairs", "wire_splits"]
