"""Building graphs: `b.rms_norm(x, w, eps=...)` appends a node of the op of that name."""

from __future__ import annotations

from collections.abc import Callable

from dsl.graph import Graph, Node, Value
from dsl.ops import OPS
from dsl.tensor import Dim, TensorType


class GraphBuilder:
    """Appends nodes in program order. Any registered op is a method: `b.linear(x, w)` returns its output
    value (a tuple for multi-output ops); keyword arguments become the node's attributes."""

    def __init__(self) -> None:
        self.graph = Graph()
        self._count = 0

    def input(self, name: str, shape: tuple[Dim, ...], dtype: str) -> Value:
        value = Value(name, TensorType(tuple(shape), dtype))
        self.graph.inputs[name] = value
        return value

    def param(self, name: str, shape: tuple[int, ...], dtype: str) -> Value:
        """The weight `name`; declaring it twice returns the same value."""
        if name not in self.graph.params:
            self.graph.params[name] = Value(name, TensorType(tuple(shape), dtype))
        return self.graph.params[name]

    def output(self, name: str, value: Value) -> None:
        self.graph.outputs[name] = value

    def call(self, op: str, *inputs: Value | None, **attrs) -> Value | tuple[Value, ...]:
        if op not in OPS:
            raise KeyError(f"unknown op {op!r}")
        node = Node(op, list(inputs), attrs)
        for _ in range(OPS[op].num_outputs):
            self._count += 1
            node.outputs.append(Value(f"{self._count}", producer=node))
        self.graph.nodes.append(node)
        return node.outputs[0] if len(node.outputs) == 1 else tuple(node.outputs)

    def __getattr__(self, op: str) -> Callable[..., Value | tuple[Value, ...]]:
        if op.startswith("_") or op not in OPS:
            raise AttributeError(op)
        return lambda *inputs, **attrs: self.call(op, *inputs, **attrs)
