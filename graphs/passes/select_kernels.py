"""Kernel selection: each node whose op has a lowering that applies to it (kernels/registry.py) gets its template,
typed static shapes (as they are on the plan's target: `Lowering.on_target`), weight formats and backend. The backend
is the target's rule (`Target.backends`, preferred first) among the template's own, skipping one this machine cannot
build (said once, kernels.registry.buildable); a node none of whose backends qualifies runs its reference."""

from __future__ import annotations

from dataclasses import replace

import torch

from dsl.graph import Graph
from graphs.plan import Plan
from kernels.lowering import Lowering, Variant
from kernels.registry import LOWERINGS, buildable
from kernels.targets import get_target


def backend_for(lowering: Lowering, target: str) -> str | None:
    """The first of the target's backends that the lowering has and this machine builds."""
    return next((b for b in get_target(target).backends if b in lowering.backends and buildable(b)), None)


def select_kernels(plan: Plan, graph: Graph, params: dict[str, torch.Tensor]) -> Plan:
    if not get_target(plan.target).backends:
        raise ValueError(f"target {plan.target!r} builds no kernels: its compiled models run the references")
    nodes = []
    for node, entry in zip(graph.nodes, plan.nodes, strict=True):
        lowering = LOWERINGS.get(node.op)
        static = None if lowering is None else lowering.static(node, params)
        if static is not None:
            static = lowering.on_target(static, get_target(plan.target))
        backend = None if static is None else backend_for(lowering, plan.target)
        if backend is None:
            nodes.append(entry)
            continue
        nodes.append(replace(entry, template=lowering.template, static=static, variant=Variant(backend),
                             formats=lowering.formats(static)))
    return replace(plan, nodes=nodes)


__all__ = ["backend_for", "select_kernels"]
