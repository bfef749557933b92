"""The e4m3 rewrite of a plan with fp8 activations: linears over fp8 weights take their form with e4m3 activations
(`Lowering.fp8_activations`: the fp8 GEMM on one scale per weight row and per token), and a node whose output only
such linears read (as their first input; an RMSNorm, or the hyper-connections' collapse + RMSNorm: the attention's
wq_a and wkv, the q_norm's wq_b's) writes it as e4m3 rows, which they take as they are (`Variant.e4m3_out` and
`e4m3_in`): one pass over the row instead of a norm, then a rounding per linear. The fused rounding is Triton's, so
such a producer runs its Triton kernel. A graph output stays fp32."""

from __future__ import annotations

from dataclasses import replace

from dsl.graph import Graph
from graphs.plan import NodePlan, Plan
from kernels.lowering import TRITON, Variant
from kernels.registry import LOWERINGS


def _fp8_weights(entry: NodePlan) -> NodePlan:
    lowering = LOWERINGS[entry.op]
    static = lowering.fp8_activations(entry.static)
    return entry if static is None else replace(entry, static=static, formats=lowering.formats(static))


def _takes_rows(entry: NodePlan, pos: int) -> bool:
    return pos == 0 and bool(entry.template) and LOWERINGS[entry.op].takes_e4m3(entry.static)


def fp8_activations(plan: Plan, graph: Graph) -> Plan:
    nodes = [_fp8_weights(n) if n.template else n for n in plan.nodes]
    readers: dict[int, list[tuple[int, int]]] = {}  # id(value) -> (node, input position) of every read
    for i, node in enumerate(graph.nodes):
        for pos, v in enumerate(node.inputs):
            if v is not None:
                readers.setdefault(id(v), []).append((i, pos))
    outputs = {id(v) for v in graph.outputs.values()}
    for i, node in enumerate(graph.nodes):
        if not nodes[i].template or not LOWERINGS[node.op].writes_e4m3 or id(node.outputs[0]) in outputs:
            continue
        reads = readers.get(id(node.outputs[0]), [])
        if reads and all(_takes_rows(nodes[j], pos) for j, pos in reads):
            nodes[i] = replace(nodes[i], variant=Variant(TRITON, e4m3_out=True))
            for j, _ in reads:
                nodes[j] = replace(nodes[j], variant=replace(nodes[j].variant, e4m3_in=True))
    return replace(plan, nodes=nodes)


__all__ = ["fp8_activations"]
