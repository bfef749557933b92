"""The plan passes: `make_plan` is `choose_configs(fp8_activations(select_kernels(graph)))`, the middle pass only
for plans with fp8 activations.

`DEEPINFER_DEBUG=ir` prints the plan after each pass, as dsl/passes prints the IR.
"""

from __future__ import annotations

import os
import sys

import torch

from autotune import TuningCache
from dsl.graph import Graph
from graphs.passes.choose_configs import choose_configs
from graphs.passes.fp8_activations import fp8_activations as rewrite_fp8_activations
from graphs.passes.select_kernels import select_kernels
from graphs.plan import BUCKETS, NodePlan, Plan


def make_plan(graph: Graph, params: dict[str, torch.Tensor], target: str, buckets: tuple[int, ...] = BUCKETS,
              dot_fp32: bool = False, tuning: TuningCache | None = None, fp8_activations: bool = False,
              expert_shards: int = 1) -> Plan:
    """The kernel for every node that has one on `target` (its backend the target's rule), with `fp8_activations`
    the e4m3 forms, then per bucket its GEMMs and config (tuned when cached, keyed by the whole layer where `params`
    hold one of `expert_shards` shares of the routed experts) and its batch-invariant config."""
    plan = Plan(target, [NodePlan(i, node.op) for i, node in enumerate(graph.nodes)], tuple(buckets), dot_fp32,
                fp8_activations)
    plan = _after("select_kernels", select_kernels(plan, graph, params))
    if fp8_activations:
        plan = _after("fp8_activations", rewrite_fp8_activations(plan, graph))
    return _after("choose_configs", choose_configs(plan, tuning, expert_shards))


def _after(name: str, plan: Plan) -> Plan:
    if "ir" in os.environ.get("DEEPINFER_DEBUG", "").split(","):
        print(f"// after {name}\n{plan}", file=sys.stderr)
    return plan


__all__ = ["choose_configs", "make_plan", "rewrite_fp8_activations", "select_kernels"]
