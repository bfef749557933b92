"""The graph IR: values, nodes and graphs. Nodes are kept in program order, which is also a topological order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsl.tensor import TensorType


@dataclass(eq=False)
class Value:
    name: str
    type: TensorType | None = None
    producer: Node | None = None

    def __repr__(self) -> str:
        return f"%{self.name}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Value | None]
    attrs: dict[str, Any]
    outputs: list[Value] = field(default_factory=list)

    def __str__(self) -> str:
        outs = ", ".join(f"%{v.name}: {v.type}" for v in self.outputs)
        ins = ", ".join("None" if v is None else f"%{v.name}" for v in self.inputs)
        attrs = ", ".join(f"{k}={_short(v)}" for k, v in self.attrs.items())
        return f"{outs} = {self.op}({ins}{', ' if ins and attrs else ''}{attrs})"


@dataclass(eq=False)
class Graph:
    """A model graph: named inputs, named parameters (weights), nodes and outputs."""

    inputs: dict[str, Value] = field(default_factory=dict)
    params: dict[str, Value] = field(default_factory=dict)
    nodes: list[Node] = field(default_factory=list)
    outputs: dict[str, Value] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"graph({', '.join(f'%{v.name}: {v.type}' for v in self.inputs.values())}) "
                 f"with {len(self.params)} params, {len(self.nodes)} nodes {{"]
        lines += [f"  {node}" for node in self.nodes]
        lines.append(f"  return {', '.join(f'{k}=%{v.name}' for k, v in self.outputs.items())}")
        lines.append("}")
        return "\n".join(lines)

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for node in self.nodes:
            counts[node.op] = counts.get(node.op, 0) + 1
        return counts


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
