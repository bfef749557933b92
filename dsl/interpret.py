"""Runs a graph with every op's torch reference: the semantics of the DSL, and the cpu target."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dsl.context import ForwardContext
from dsl.graph import Graph
from dsl.ops import OPS
from dsl.tensor import TensorType


def interpret(graph: Graph, inputs: dict[str, Any], params: dict[str, Any], ctx: ForwardContext,
              kernels: dict[str, Callable] | None = None) -> dict[str, Any]:
    """Run `graph`; `kernels` maps op names to implementations used instead of their reference (same signature).
    A node whose op sets the context (`decoder_context`) gives the context every later node runs in; where that has
    no rows, the outputs not made yet are empty."""
    kernels = kernels or {}
    env: dict = {}
    for name, value in graph.inputs.items():
        env[value] = inputs[name]
    for name, value in graph.params.items():
        env[value] = params[name]
    for node in graph.nodes:
        opdef = OPS[node.op]
        args = [None if v is None else env[v] for v in node.inputs]
        kwargs = dict(node.attrs, ctx=ctx) if opdef.uses_context else node.attrs
        result = kernels.get(node.op, opdef.reference)(*args, **kwargs)
        if opdef.sets_context:
            ctx = result
            if ctx.num_tokens == 0:  # every later node runs over no row: nothing to compute, nothing to store
                return {name: env[v] if v in env else empty_output(v.type, ctx.device)
                        for name, v in graph.outputs.items()}
            continue
        if opdef.num_outputs == 1:
            result = (result,)
        for value, r in zip(node.outputs, result, strict=True):
            env[value] = r
    return {name: env[v] for name, v in graph.outputs.items()}


def empty_output(t: TensorType, device: torch.device) -> torch.Tensor:
    """An empty tensor of type `t` (its symbolic dims, all over the token count, 0)."""
    return torch.empty([d if isinstance(d, int) else 0 for d in t.shape], dtype=getattr(torch, t.dtype), device=device)
