"""Fusion: rewrite op patterns into fused ops that make one pass over memory instead of two.

Rules are (first op, second op, fused op, attrs taken from the second); a pair fuses when the second is the
only reader of the first's output and reads it as its first input.
"""

from __future__ import annotations

from dsl.graph import Graph, Node, Value

RULES = [
    # The collapsed streams feed straight into the sub-layer's norm: read the hc streams once.
    ("hc_collapse", "rms_norm", "hc_collapse_rms_norm"),
]


def _readers(graph: Graph) -> dict[Value, list[Node]]:
    readers: dict[Value, list[Node]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None:
                readers.setdefault(v, []).append(node)
    return readers


def fuse(graph: Graph) -> Graph:
    for first_op, second_op, fused_op in RULES:
        readers = _readers(graph)
        outputs = set(graph.outputs.values())
        absorbed: set[Node] = set()
        for node in graph.nodes:
            if node.op != first_op or node.outputs[0] in outputs:
                continue
            users = readers.get(node.outputs[0], [])
            if len(users) != 1 or users[0].op != second_op or users[0].inputs[0] is not node.outputs[0]:
                continue
            second = users[0]
            if any(v is None for v in second.inputs):
                continue
            # The second node becomes the fused one in place: everything it now reads is defined before it.
            second.op, second.inputs = fused_op, node.inputs + second.inputs[1:]
            absorbed.add(node)
        graph.nodes = [n for n in graph.nodes if n not in absorbed]
    return graph
