"""Runs a graph with every op's torch reference: the semantics of the DSL, and the cpu target.

A `Program` is a graph made ready to run many times: each node's implementation looked up once, its inputs and
outputs numbered slots of a list rather than keys of a dict, its keywords built once (the context is the one added
per forward). `interpret` builds one and runs it once; the cpu target's runtime keeps one per graph and mode.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch

from dsl.context import ForwardContext
from dsl.graph import Graph
from dsl.ops import OPS
from dsl.tensor import TensorType


class Program:
    """`graph` with `kernels` (op name -> implementation used instead of its reference, same signature) bound."""

    def __init__(self, graph: Graph, kernels: dict[str, Callable] | None = None) -> None:
        kernels = kernels or {}
        slots: dict = {}
        for value in [*graph.inputs.values(), *graph.params.values()]:
            slots.setdefault(value, len(slots))
        self.inputs = [(name, slots[v]) for name, v in graph.inputs.items()]
        self.params = [(name, slots[v]) for name, v in graph.params.items()]
        # The params' slots, where they are consecutive (each its own Value): bound in one slice assignment.
        first = self.params[0][1] if self.params else 0
        consecutive = [s for _, s in self.params] == list(range(first, first + len(self.params)))
        self._param_slots = slice(first, first + len(self.params)) if consecutive else None
        self._param_values = _getter([name for name, _ in self.params])
        none = len(slots)  # a slot that always holds None: a node's missing input
        slots[None] = none
        # per node: implementation, what reads its inputs from the slots (a tuple), attributes, whether it takes /
        # sets the context, its output's slot (an int) or its outputs' (a list)
        self.steps: list[tuple[Callable, Callable[[list], tuple], dict, bool, bool, int | list[int]]] = []
        for node in graph.nodes:
            opdef = OPS[node.op]
            inputs = _getter([slots[v] for v in node.inputs])
            outputs = [slots.setdefault(v, len(slots)) for v in node.outputs]
            single = opdef.num_outputs == 1 and not opdef.sets_context
            self.steps.append((kernels.get(node.op, opdef.reference), inputs, node.attrs, opdef.uses_context,
                               opdef.sets_context, outputs[0] if single else outputs))
        self.size = len(slots)
        self.outputs = [(name, slots.get(v), v.type) for name, v in graph.outputs.items()]

    def run(self, inputs: dict[str, Any], params: dict[str, Any], ctx: ForwardContext) -> dict[str, Any]:
        """The graph's outputs by name. A node whose op sets the context (`decoder_context`) gives the context every
        later node runs in; where that has no rows, the outputs not made yet are empty."""
        env: list = [None] * self.size
        for name, slot in self.inputs:
            env[slot] = inputs[name]
        if self._param_slots is not None:
            env[self._param_slots] = self._param_values(params)
        else:
            for name, slot in self.params:
                env[slot] = params[name]
        for fn, ins, attrs, uses_context, sets_context, out in self.steps:
            result = fn(*ins(env), **attrs, ctx=ctx) if uses_context else fn(*ins(env), **attrs)
            if sets_context:
                ctx = result
                if ctx.num_tokens == 0:  # every later node runs over no row: nothing to compute, nothing to store
                    return {name: env[s] if s is not None and env[s] is not None else empty_output(t, ctx.device)
                            for name, s, t in self.outputs}
            elif type(out) is int:
                env[out] = result
            else:
                for slot, r in zip(out, result, strict=True):
                    env[slot] = r
        return {name: env[s] for name, s, _ in self.outputs}


def _getter(keys: list) -> Callable[[Any], tuple]:
    """What reads `keys` of a list or dict as a tuple, in one call (`operator.itemgetter`, which returns a lone item
    bare)."""
    if len(keys) > 1:
        return operator.itemgetter(*keys)
    if keys:
        key = keys[0]
        return lambda env: (env[key],)
    return lambda env: ()


def interpret(graph: Graph, inputs: dict[str, Any], params: dict[str, Any], ctx: ForwardContext,
              kernels: dict[str, Callable] | None = None) -> dict[str, Any]:
    """Run `graph` once (`Program`); `kernels` maps op names to implementations used instead of their reference."""
    return Program(graph, kernels).run(inputs, params, ctx)


def empty_output(t: TensorType, device: torch.device) -> torch.Tensor:
    """An empty tensor of type `t` (its symbolic dims, all over the token count, 0)."""
    return torch.empty([d if isinstance(d, int) else 0 for d in t.shape], dtype=getattr(torch, t.dtype), device=device)
