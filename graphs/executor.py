"""Runs a planned graph on a device: kernel nodes through their lowering, the rest through the DSL reference.

It reads like `dsl.interpret` (the cpu target), which it mirrors node for node. Weights are placed on the device
once, and converted once per format a kernel asks for (plain weights to bf16, or fp32 when the plan multiplies
in fp32; fp8 32x32-block weights to one scale per row where the plan rounds activations to e4m3; the fp4 experts'
codes to the order of the tensor cores' fragments, and their power-of-two scales to the bf16 factor their kernel
multiplies codes by). A weight that only kernels read, all through formats that copy it (`RELAID`), keeps only its
converted copy on the device: the fp4 experts are most of the model's bytes. Kernel
launches go through whatever launcher is current: Triton's JIT, or an artifact's cubins.
`run(..., batch_invariant=True)` gives every kernel node its batch-invariant config. Under expert parallelism
(`parallel_experts`: kernels/moe/expert_parallel_kernel.py) the MoE nodes hold this rank's experts and exchange their
pairs with the other ranks; their shapes then follow the exchange, so they stay out of the CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsl.graph import Graph
from dsl.interpret import empty_output
from dsl.ops import OPS
from dsl.ragged import Ragged
from dsl.step import StaticStep
from graphs.capture import CudaGraphs
from graphs.draws import DRAWN, draw
from graphs.plan import Plan
from kernels.linear.fp8 import rowwise_weight
from kernels.moe.expert_parallel_kernel import ParallelMoeKernel
from kernels.moe.experts import prescaled
from kernels.moe.fragments import fragment_codes
from kernels.moe.lowering import MOE_EXPERTS
from kernels.registry import LOWERINGS

EXCHANGED = frozenset({"moe_experts"})  # the ops that exchange rows with other ranks under expert parallelism
RELAID = frozenset({"fragments"})  # formats whose copy replaces the weight on the device where nothing reads it raw


class Executor:
    def __init__(self, graph: Graph, plan: Plan, params: dict[str, torch.Tensor], device: str | torch.device,
                 formatted: dict[tuple[str, str], torch.Tensor] | None = None, cuda_graphs: bool = False,
                 parallel_experts: ParallelMoeKernel | None = None, draws: bool = True) -> None:
        """`formatted`: another executor's converted weights, shared (a DSpark draft graph beside its model's).
        `cuda_graphs`: replay the graph's static segments as CUDA graphs (graphs/capture.py), whose static steps
        draw their rows' next tokens where `draws` (graphs/draws.py; not a draft graph's). `parallel_experts`: the
        MoE nodes run over this rank's experts through it (expert parallelism), outside the CUDA graphs."""
        plan.check_graph(graph)
        self.graph, self.plan, self.device = graph, plan, torch.device(device)
        self.parallel_experts = parallel_experts
        self.uncaptured = EXCHANGED if parallel_experts is not None else frozenset()
        if parallel_experts is not None:
            referenced = [n.index for n in plan.nodes if n.op in EXCHANGED and not n.template]
            if referenced:
                raise ValueError(f"expert parallelism needs the MoE kernel on every MoE node; node(s) {referenced} "
                                 "run their reference, which would see this rank's experts only")
        self.params = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in params.items()}
        self.formatted: dict[tuple[str, str], torch.Tensor] = {} if formatted is None else formatted
        for node in plan.kernel_nodes():  # convert now: a forward allocates no weights
            for pos, fmt in node.formats.items():
                v = graph.nodes[node.index].inputs[pos]
                if v is not None and v.name in self.params:
                    self.param(v.name, fmt)
        self._drop_relaid()
        # the node that sets the context (bounded replay's `decoder_context`), if any
        self.boundary = next((i for i, n in enumerate(graph.nodes) if OPS[n.op].sets_context), None)
        self.kernel_calls = 0
        self.draws = draws
        self.cuda_graphs = CudaGraphs(graph, uncaptured=self.uncaptured, draws=draws) if cuda_graphs else None

    def param(self, name: str, fmt: str) -> torch.Tensor:
        key = (name, fmt)
        if key not in self.formatted and fmt in ("fp8_rows", "fp8_rows_scale"):
            # a weight "X.weight" and its block scales "X.scale" become (codes, a scale per row) together
            prefix = name.removesuffix("weight" if fmt == "fp8_rows" else "scale")
            if prefix + "weight" not in self.params or prefix + "scale" not in self.params:
                raise KeyError(f"{name}: an fp8 weight needs its block scales beside it as {prefix}scale")
            codes, rows = rowwise_weight(self.params[prefix + "weight"], self.params[prefix + "scale"])
            self.formatted[(prefix + "weight", "fp8_rows")] = codes
            self.formatted[(prefix + "scale", "fp8_rows_scale")] = rows
        if key not in self.formatted:
            t = self.params[name]
            if fmt == "plain":
                fmt = "fp32" if self.plan.dot_fp32 else "bf16"
            if fmt == "bf16":
                t = t.to(torch.bfloat16)
            elif fmt == "fp32":
                t = t.float()
            elif fmt == "prescaled":  # fp4 experts' scales as the kernel's bf16 factor (kernels/moe/experts.py)
                t = prescaled(t)
            elif fmt == "fragments":  # fp4 experts' codes in fragment order (kernels/moe/fragments.py)
                t = fragment_codes(t)
            self.formatted[key] = t.contiguous()
        return self.formatted[key]

    def _raw_reads(self) -> set[str]:
        """The weights some node of this graph reads as they are stored: through its reference, or as a kernel
        input with no format."""
        reads = set()
        for node, entry in zip(self.graph.nodes, self.plan.nodes, strict=True):
            for pos, v in enumerate(node.inputs):
                if v is not None and v.name in self.graph.params and not (entry.template and pos in entry.formats):
                    reads.add(v.name)
        return reads | {v.name for v in self.graph.outputs.values() if v.name in self.graph.params}

    def _drop_relaid(self) -> None:
        """Keep only the converted copy of each weight converted to a `RELAID` format that this graph never reads raw
        (a kernel node's arguments are then replaced by the copy anyway). An executor on another's weights (the
        draft graph's) must not read raw what that one dropped: checked here."""
        raw = self._raw_reads()
        relaid = {name: t for (name, fmt), t in self.formatted.items() if fmt in RELAID and name in self.params}
        dropped = {name for name, t in relaid.items() if self.params[name] is t}
        if raw & dropped:
            raise ValueError(f"weights {sorted(raw & dropped)} are read raw here, but another executor kept only their "
                             f"converted copies")
        for name, t in relaid.items():
            if name not in raw:
                self.params[name] = t

    def run(self, inputs: dict[str, Any], ctx, batch_invariant: bool = False,
            trace: Callable[[int, tuple], None] | None = None) -> dict[str, Any]:
        """The graph's outputs. `trace(index, outputs)` sees every node's outputs as they are made
        (bench/invariance_probe.py), every node then eager."""
        graph = self.graph
        env: dict = {value: inputs[name] for name, value in graph.inputs.items()}
        env |= {value: self.params[name] for name, value in graph.params.items()}
        forward, replays = None, True
        if self.cuda_graphs is not None and trace is None:
            forward = self.cuda_graphs.begin(ctx, (batch_invariant,))
        index = 0
        while index < len(graph.nodes):
            if index == self.boundary:  # bounded replay's boundary: later nodes run in its view
                view = OPS[graph.nodes[index].op].reference(**graph.nodes[index].attrs, ctx=ctx)
                index += 1
                if view is ctx:
                    continue
                ctx, replays = view, False  # fewer rows than the forward's bucket: the rest runs eagerly
                if ctx.num_tokens == 0:  # no row left to compute or store
                    env |= {v: empty_output(v.type, ctx.device) for v in graph.outputs.values() if v not in env}
                    break
                continue
            segment = forward and replays and forward.at.get(index)
            if segment:
                def run_nodes(env: dict, ctx, segment=segment) -> None:
                    for i in range(segment.start, segment.stop):
                        self._node(i, env, ctx, batch_invariant)
                    if isinstance(ctx, StaticStep) and DRAWN in segment.outputs:  # a static step's tokens
                        draw(env, graph.outputs["logits"], ctx)
                forward.run(segment, env, run_nodes)
                index = segment.stop
                continue
            result = self._node(index, env, ctx, batch_invariant)
            if trace is not None:
                trace(index, result)
            index += 1
        outputs = {name: env[v] for name, v in graph.outputs.items()}
        if DRAWN in env:
            outputs["drawn"] = env[DRAWN]
        return outputs if forward is None else forward.finish(outputs)

    def _node(self, index: int, env: dict, ctx, batch_invariant: bool) -> tuple:
        """Run node `index` over `env` (its outputs added to it); returns them."""
        node, entry = self.graph.nodes[index], self.plan.nodes[index]
        opdef = OPS[node.op]
        args = [None if v is None else env[v] for v in node.inputs]
        if entry.template and isinstance(args[0], (torch.Tensor, Ragged)):
            result = self._kernel(node, entry, args, ctx, batch_invariant)
        else:
            kwargs = dict(node.attrs, ctx=ctx) if opdef.uses_context else node.attrs
            result = opdef.reference(*args, **kwargs)
        if opdef.num_outputs == 1:
            result = (result,)
        for value, r in zip(node.outputs, result, strict=True):
            env[value] = r
        return result

    def _kernel(self, node, entry, args: list, ctx, batch_invariant: bool) -> Any:
        """A kernel node through its lowering; a `Ragged` first argument (compressed entries) runs on its rows."""
        for pos, fmt in entry.formats.items():
            v = node.inputs[pos]
            if v is not None and v.name in self.graph.params:
                args[pos] = self.param(v.name, fmt)
        lowering = LOWERINGS[node.op]
        ragged = args[0] if isinstance(args[0], Ragged) and not lowering.ragged else None
        if ragged is not None:
            args[0] = ragged.values
        rows = args[0].values.shape[0] if isinstance(args[0], Ragged) else args[0].shape[0]
        chosen = entry.at(rows, self.plan.buckets, batch_invariant)
        call = entry.call(chosen, node.attrs, self.plan.dot_fp32, args, ctx)
        if self.parallel_experts is not None and node.op in EXCHANGED:
            buckets, topk = self.plan.buckets, entry.static.topk
            # an owner's pairs take the config of the tokens that would make as many pairs on one device
            result = MOE_EXPERTS.run_parallel(call, self.parallel_experts, batch_invariant,
                                              lambda p: entry.at(-(-p // topk), buckets, batch_invariant).config)
            self.kernel_calls += 1
            return result
        result = lowering.run(call)
        self.kernel_calls += 1
        return result if ragged is None else ragged.replace(result)

    def serve_experts(self, batch_invariant: bool, start: int = 0) -> None:
        """Every MoE node (from node `start` on) with zero rows of this rank's own: its experts serve the other ranks'
        forward (a rank with nothing to run, or none past bounded replay's boundary, under expert parallelism)."""
        for index, node in enumerate(self.graph.nodes):
            if index < start or node.op not in EXCHANGED:
                continue
            static = self.plan.nodes[index].static
            none = torch.empty(0, static.d, device=self.device)
            args = [none, none.new_empty(0, static.topk), none.new_empty(0, static.topk, dtype=torch.int64)]
            args += [None if v is None else self.params[v.name] for v in node.inputs[3:]]
            self._kernel(node, self.plan.nodes[index], args, None, batch_invariant)


__all__ = ["EXCHANGED", "Executor"]
