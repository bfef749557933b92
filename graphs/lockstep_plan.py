"""A plan runtime's forwards and idle passes as one rank of several (expert parallelism; graphs/lockstep.py agrees
on them).

The plan and its cubins are the ones every rank shares; the weights hold this rank's routed experts only. Every MoE
node runs the plan's MoE kernel over them, its pairs exchanged with the other ranks
(kernels/moe/expert_parallel_kernel.py), eagerly between the CUDA graphs' segments; an idle pass runs just the MoE
nodes, with zero rows of this rank's own, under the same launcher as a forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsl.context import ForwardContext
from graphs.plan_runtime import PlanRuntime
from kernels.moe.exchange import ExpertExchange
from kernels.moe.expert_parallel_kernel import ParallelMoeKernel


class PlannedRank:
    """`inner`'s forwards with its MoE nodes split over `group`'s ranks."""

    def __init__(self, inner: PlanRuntime, group: dist.ProcessGroup | None) -> None:
        self.inner = inner
        inner.split_experts(ParallelMoeKernel(ExpertExchange(group)))

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, batch_invariant: bool,
                draft: bool) -> dict[str, torch.Tensor]:
        return self.inner.run(input_ids, ctx, batch_invariant, draft)

    def idle(self, batch_invariant: bool, draft: bool, start: int = 0) -> None:
        """The forward's MoE nodes from node `start` on, with zero rows of this rank's own."""
        main, drafts = self.inner.executors()
        executor = drafts if draft else main
        if executor is None:
            raise RuntimeError("this model was compiled without DSpark drafting: compile(..., drafting=True)")
        with self.inner.launches():
            executor.serve_experts(batch_invariant, start)


__all__ = ["PlannedRank"]
