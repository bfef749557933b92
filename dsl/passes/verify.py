"""Verification: values defined before use, outputs defined, and the contraction dims of linears agree."""

from __future__ import annotations

from dsl.graph import Graph
from dsl.ops import OPS
from dsl.tensor import dims_equal


def verify(graph: Graph) -> Graph:
    defined = set(graph.inputs.values()) | set(graph.params.values())
    for i, node in enumerate(graph.nodes):
        if node.op not in OPS:
            raise ValueError(f"node {i}: unknown op {node.op!r}")
        for v in node.inputs:
            if v is not None and v not in defined:
                raise ValueError(f"node {i} ({node.op}) reads %{v.name} before it is defined")
        if node.op == "linear":
            x, w = node.inputs[0].type, node.inputs[1].type
            in_dim = w.shape[1] * 2 if w.dtype == "uint8" else w.shape[1]  # fp4 packs two values a byte
            if not dims_equal(x.shape[-1], in_dim):
                raise ValueError(f"node {i} (linear): input dim {x.shape[-1]} does not match weight "
                                 f"%{node.inputs[1].name} {w}")
        defined.update(node.outputs)
    for name, v in graph.outputs.items():
        if v not in defined:
            raise ValueError(f"graph output {name!r} is never defined")
    return graph
