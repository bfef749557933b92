"""Config choice: per bucket of every kernel node, the GEMMs its projections run (`Lowering.gemms`) and their config,
tuned where the tuning cache holds one for the node's key (`Lowering.key`, the template's source hash, the target's
tuning device) and the kernels are ones the tuner searches (`Lowering.tunable`), else the heuristic, completed with
the keys the tuner does not search (`Lowering.complete`); then the batch-invariant config (graphs/plan.py). A plan
of one rank's share of the routed experts (`expert_shards` > 1) is keyed by the whole layer's shapes
(`Lowering.whole`): configs are tuned on whole layers, and an owner's pairs take the config of the token count that
makes as many pairs on one device (graphs/executor.py)."""

from __future__ import annotations

from dataclasses import replace

from autotune import TuningCache, choose, template_hash
from graphs.plan import INVARIANT_TOKENS, BucketPlan, NodePlan, Plan
from kernels.registry import LOWERINGS


def _bucket(plan: Plan, node: NodePlan, bucket: int, tuning: TuningCache | None, expert_shards: int) -> BucketPlan:
    lowering = LOWERINGS[node.op]
    gemms = lowering.gemms(node.static, bucket, plan.dot_fp32)

    def fallback() -> dict:
        return lowering.default_config(node.static, bucket, node.variant, gemms)

    if not lowering.tunable(gemms):
        return BucketPlan(fallback(), "heuristic", gemms)
    static = lowering.whole(node.static, expert_shards)
    config, source = choose(lowering.template, lowering.key(static, node.variant), bucket, plan.target,
                            template_hash(lowering.template), fallback, tuning)
    return BucketPlan(lowering.complete(config, node.static, bucket), source, gemms)


def choose_configs(plan: Plan, tuning: TuningCache | None = None, expert_shards: int = 1) -> Plan:
    nodes = []
    for node in plan.nodes:
        if node.template:
            node = replace(node, buckets={b: _bucket(plan, node, b, tuning, expert_shards) for b in plan.buckets})
            chosen = node.at(INVARIANT_TOKENS, plan.buckets)
            node.invariant = replace(chosen, config=LOWERINGS[node.op].invariant(chosen.config))
        nodes.append(node)
    return replace(plan, nodes=nodes)


__all__ = ["choose_configs"]
