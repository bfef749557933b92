"""Shape inference: give every node output its type from the op's shape rule."""

from __future__ import annotations

from dsl.graph import Graph
from dsl.ops import OPS


def infer_shapes(graph: Graph) -> Graph:
    for node in graph.nodes:
        types = [None if v is None else v.type for v in node.inputs]
        missing = [str(v) for v, t in zip(node.inputs, types, strict=True) if v is not None and t is None]
        if missing:
            raise ValueError(f"{node.op}: inputs {missing} have no type (used before they are defined?)")
        out_types = OPS[node.op].infer(*types, **node.attrs)
        if len(out_types) != len(node.outputs):
            raise ValueError(f"{node.op}: shape rule gives {len(out_types)} outputs, node has {len(node.outputs)}")
        for value, t in zip(node.outputs, out_types, strict=True):
            value.type = t
    return graph
