"""A runtime as one rank of several (expert parallelism): every rank runs each forward together.

Each rank runs its own requests (data-parallel attention), but the routed experts are split over the ranks: every
MoE layer of a forward is an all-to-all that every rank must join (kernels/moe/exchange.py). So the ranks agree
before each forward: a rank that wants to run a graph, or has nothing to run (`finish`), says so in one small
all_reduce; the first graph anyone wants runs on every rank, on its own tokens for those that want it and as an idle
pass (each MoE layer with zero rows, serving the others) for the rest, and the agreement repeats until every rank has
run what it wanted and every rank is finished. The graph's kind includes batch-invariant mode, which the experts'
arithmetic follows on whichever rank they run. The agreement is the same whatever runs the graphs; how a forward and
an idle pass run is the rank's: `InterpretedRank` here (the interpreter, every op's reference, the experts of
kernels/moe/expert_parallel.py), `PlannedRank` (graphs/lockstep_plan.py: a plan's kernels, the MoE kernel of
kernels/moe/expert_parallel_kernel.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch.distributed as dist

from dsl.context import ForwardContext
from dsl.graph import Graph
from dsl.interpret import interpret
from graphs.interpreter import Interpreter
from graphs.lockstep_plan import PlannedRank
from graphs.plan_runtime import PlanRuntime
from graphs.runtime import FatalRuntimeError, select_graph
from graphs.segments import StepSegment
from kernels.moe.expert_parallel import ExpertParallelExperts

# The kinds of forward the ranks agree on: (draft graph, batch-invariant)
KINDS = ((False, True), (False, False), (True, True), (True, False))


class InterpretedRank:
    """The interpreter's forwards and idle passes with the routed experts split over `group`'s ranks."""

    def __init__(self, inner: Interpreter, group: dist.ProcessGroup | None) -> None:
        self.inner = inner
        self._experts = {invariant: ExpertParallelExperts(group, invariant) for invariant in (True, False)}

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext, batch_invariant: bool,
                draft: bool) -> dict[str, torch.Tensor]:
        kernels = self.inner.implementations(batch_invariant) | {"moe_experts": self._experts[batch_invariant]}
        return interpret(self._graph(draft), {"input_ids": input_ids}, self.inner.params, ctx, kernels)

    def idle(self, batch_invariant: bool, draft: bool, start: int = 0) -> None:
        """Every MoE layer of the forward (from node `start` on) with zero rows of this rank's own: its experts serve
        the others."""
        graph, experts = self._graph(draft), self._experts[batch_invariant]
        names = {value: name for name, value in graph.params.items()}
        for node in graph.nodes[start:]:
            if node.op != "moe_experts":
                continue
            stored = [None if v is None else self.inner.params[names[v]] for v in node.inputs[3:]]
            width = stored[1].shape[1]  # w2 [E / ranks, D, I]: the hidden size
            none = torch.empty(0, width, device=self.inner.device)
            experts(none, none[:, :1], none[:, :1].long(), *stored, **node.attrs)

    def _graph(self, draft: bool) -> Graph:
        return select_graph(self.inner.graph, self.inner.draft_graph, draft)


class LockstepRuntime:
    """Runs `inner`'s graphs as rank `dist.get_rank(group)` of `group`, the routed experts split over the ranks."""

    def __init__(self, inner: Interpreter | PlanRuntime, group: dist.ProcessGroup | None = None) -> None:
        self.inner, self.group = inner, group
        self.device = inner.device
        self.rank = dist.get_rank(group)
        self._rank = PlannedRank(inner, group) if isinstance(inner, PlanRuntime) else InterpretedRank(inner, group)
        self._boundaries: dict[bool, tuple[int, int] | None] = {}  # per graph: bounded replay's (node index, window)
        self.num_rounds = self.num_idle = 0  # agreements made and idle passes run, for the bookkeeping's cost

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self.inner.params

    def ready(self) -> None:
        self.inner.ready()

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, batch_invariant: bool,
            draft: bool = False) -> dict[str, torch.Tensor]:
        """This rank's forward, once every rank runs the same graph (idle passes first where others want others)."""
        kind = KINDS.index((draft, batch_invariant))
        while (agreed := self._agree(kind)) != kind:
            self._idle(agreed)
        try:
            out = self._rank.forward(input_ids, ctx, batch_invariant, draft)
            skipped = self._skipped_from(ctx, draft)
            if skipped is not None:  # its decoder layers had no row: their MoE layers still serve the others
                self._rank.idle(batch_invariant, draft, skipped)
            return out
        except Exception as e:  # the others wait in this forward's all-to-alls: nothing can run after it
            raise FatalRuntimeError(f"rank {self.rank}: a forward failed: {type(e).__name__}: {e}") from e

    def _skipped_from(self, ctx: ForwardContext, draft: bool) -> int | None:
        """Where a forward stopped early: the index of bounded replay's boundary (`decoder_context`) when every row
        of this forward lies before it (the runtimes compute nothing after it then), else None."""
        if draft not in self._boundaries:
            graph = select_graph(self.inner.graph, self.inner.draft_graph, draft)
            self._boundaries[draft] = next(((i, n.attrs["window"]) for i, n in enumerate(graph.nodes)
                                            if n.op == "decoder_context"), None)
        boundary = self._boundaries[draft]
        if boundary is None or ctx.decoder_view(boundary[1]).num_tokens:
            return None
        return boundary[0]

    def finish(self) -> None:
        """Serve the other ranks' forwards until every rank has nothing left to run."""
        while (agreed := self._agree(None)) is not None:
            self._idle(agreed)

    def _agree(self, kind: int | None) -> int | None:
        """The first kind of forward any rank wants now (None: no rank wants one)."""
        wants = torch.zeros(len(KINDS), dtype=torch.int32, device=self.device)
        if kind is not None:
            wants[kind] = 1
        try:
            dist.all_reduce(wants, op=dist.ReduceOp.MAX, group=self.group)
        except Exception as e:
            raise FatalRuntimeError(f"rank {self.rank}: the ranks cannot agree on the next forward (another rank "
                                    f"failed or is gone): {type(e).__name__}: {e}") from e
        self.num_rounds += 1
        chosen = torch.nonzero(wants).flatten().tolist()
        return chosen[0] if chosen else None

    def _idle(self, kind: int) -> None:
        """The `kind` forward's MoE layers with zero rows of this rank's own: its experts serve the others."""
        draft, invariant = KINDS[kind]
        self.num_idle += 1
        try:
            self._rank.idle(invariant, draft)
        except Exception as e:
            raise FatalRuntimeError(f"rank {self.rank}: serving another rank's forward failed: "
                                    f"{type(e).__name__}: {e}") from e

    def sampling(self) -> AbstractContextManager:
        return self.inner.sampling()

    def capture_ahead(self, tokens: int) -> None:
        self.inner.capture_ahead(tokens)

    def graph_segments(self, num_tokens: int, draft: bool = False) -> list[StepSegment]:
        return self.inner.graph_segments(num_tokens, draft)

    def save(self, path: str | Path, model_config: dict, model_dir: str | None) -> None:
        self.inner.save(path, model_config, model_dir)


__all__ = ["KINDS", "InterpretedRank", "LockstepRuntime"]
