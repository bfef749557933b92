"""The plan: for every node of a model graph, the kernel that runs it (or its reference) and, per token-count
bucket, the tuned or heuristic config, plus one batch-invariant config for every token count. Saved as plan.json;
the graph itself is rebuilt from the model.

Batch invariance (`batch_invariant=True`): a row's result must not depend on the other rows or their number. A
kernel's reduction order is fixed by its config (tiles, split-K count and ranges, warps, stages) and, in sparse
attention, by how a token's entries are split; the rows themselves never meet in a reduction. So one config per
node serves every token count: the one tuned for `INVARIANT_TOKENS` (decode batches, where the mode is mostly
used), made invariant by its lowering (`Lowering.invariant`: attention keeps a token's entries in one part, since
its split sizes follow the batch's widest entry list).

fp8 activations (`fp8_activations=True`): linears over fp8 weights take their variant with e4m3 activations
(`Lowering.fp8_activations`), and a node whose output only such linears read (an RMSNorm, or the hyper-connections'
collapse + RMSNorm: the attention's wq_a and wkv, the q_norm's wq_b's) writes it as e4m3 rows, which they take as
they are (`Lowering.e4m3_out` and `e4m3_in`): one pass over the row instead of a norm, then a rounding per linear.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field

import torch

from autotune import choose, source_hash
from dsl.graph import Graph
from graphs.lowering import LOWERINGS

BUCKETS = (16, 64, 512, 8192)  # token-count buckets: a bucket's config serves every count up to it (and beyond
# the last); decode batches fall in the first two
# templates with a TileLang kernel too: template -> its TileLang module
TILELANG_TEMPLATES = {"rms_norm": "norm.rms_norm_tilelang", "hc_collapse_rms_norm": "hyper.collapse_tilelang"}
INVARIANT_TOKENS = 64  # the token count whose config, made invariant, serves every count in batch-invariant runs


def bucket_of(m: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    return next((b for b in buckets if m <= b), buckets[-1])


@dataclass
class NodePlan:
    index: int
    op: str
    template: str | None = None  # None: the DSL reference runs it
    static: dict = field(default_factory=dict)
    formats: dict[int, str] = field(default_factory=dict)
    configs: dict[int, dict] = field(default_factory=dict)  # bucket -> config
    sources: dict[int, str] = field(default_factory=dict)  # bucket -> "tuned" | "heuristic"
    invariant: dict | None = None  # the batch-invariant config, for every token count (None: an older plan)

    def config(self, m: int, buckets: tuple[int, ...], batch_invariant: bool = False) -> dict:
        if not batch_invariant:
            return self.configs[bucket_of(m, buckets)]
        if self.invariant is None:
            raise ValueError(f"node {self.index} ({self.op}) has no batch-invariant config: the plan predates them; "
                             "compile the model again")
        return self.invariant

    def to_json(self) -> dict:
        d = {"index": self.index, "op": self.op, "template": self.template}
        if self.template:
            d |= {"static": self.static, "formats": {str(k): v for k, v in self.formats.items()},
                  "configs": {str(k): v for k, v in self.configs.items()},
                  "sources": {str(k): v for k, v in self.sources.items()}, "invariant_config": self.invariant}
        return d

    @classmethod
    def from_json(cls, d: dict) -> NodePlan:
        ints = lambda m: {int(k): v for k, v in m.items()}  # noqa: E731
        return cls(d["index"], d["op"], d.get("template"), d.get("static", {}), ints(d.get("formats", {})),
                   ints(d.get("configs", {})), ints(d.get("sources", {})), d.get("invariant_config"))


@dataclass
class Plan:
    target: str
    nodes: list[NodePlan]
    buckets: tuple[int, ...] = BUCKETS
    dot_fp32: bool = False
    fp8_activations: bool = False  # linears over fp8 weights round their activations to e4m3 (the fp8 GEMM)

    def kernel_nodes(self) -> list[NodePlan]:
        return [n for n in self.nodes if n.template]

    @property
    def has_invariant_configs(self) -> bool:
        return all(n.invariant is not None for n in self.kernel_nodes())

    def to_json(self) -> dict:
        return {"target": self.target, "buckets": list(self.buckets), "dot_fp32": self.dot_fp32,
                "fp8_activations": self.fp8_activations, "nodes": [n.to_json() for n in self.nodes]}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        return cls(d["target"], [NodePlan.from_json(n) for n in d["nodes"]], tuple(d["buckets"]), d["dot_fp32"],
                   d.get("fp8_activations", False))

    def check_graph(self, graph: Graph) -> None:
        """The plan was made for this graph: same ops in the same order."""
        ops = [n.op for n in graph.nodes]
        if ops != [n.op for n in self.nodes]:
            raise ValueError("the plan does not match the model's graph (different ops or order): recompile")


@functools.lru_cache(maxsize=None)
def _template_hash(template: str) -> str:
    """The hash of the kernel sources that serve `template` (read once per process: every node of a plan asks)."""
    module = {"linear": "linear.linear", "rms_norm": "norm.rms_norm", "hc_mixes": "hyper.hyper",
              "hc_collapse_rms_norm": "hyper.hyper", "hc_expand": "hyper.hyper", "engram_gate": "engram.gate",
              "rope": "rope.rope", "moe_experts": "moe.experts", "sparse_attention": "attention.sparse_attention",
              "swiglu": "linear.linear", "moe_gate": "linear.linear", "index_scores": "indexer.index_scores",
              "fp8_round": "rounding.rounding", "fp4_round": "rounding.rounding", "compress_pool": "compressor.pool",
              "engram_hash_rows": "engram.hash_rows", "topk_select": "indexer.topk",
              "candidate_blocks": "indexer.topk"}[template]
    src = source_hash(importlib.import_module(f"kernels.{module}"))
    if template in TILELANG_TEMPLATES:  # served by either kernel (graphs/lowering.py): an edit to one invalidates
        src += source_hash(importlib.import_module(f"kernels.{TILELANG_TEMPLATES[template]}"))
    return src


def _e4m3_rows(graph: Graph, statics: list[dict | None]) -> None:
    """Give a node that can write e4m3 rows, and its readers, their e4m3 variants where every reader can take them
    as its first input and the output is no graph output (module docstring)."""
    readers: dict[int, list[tuple[int, int]]] = {}  # id(value) -> (node, input position) of every read
    for i, node in enumerate(graph.nodes):
        for pos, v in enumerate(node.inputs):
            if v is not None:
                readers.setdefault(id(v), []).append((i, pos))
    outputs = {id(v) for v in graph.outputs.values()}

    def variant(j: int, kind: str) -> dict | None:
        return None if statics[j] is None else getattr(LOWERINGS[graph.nodes[j].op], kind)(statics[j])

    for i, node in enumerate(graph.nodes):
        out = variant(i, "e4m3_out")
        if out is None or id(node.outputs[0]) in outputs:
            continue
        reads = readers.get(id(node.outputs[0]), [])
        ins = [variant(j, "e4m3_in") if pos == 0 else None for j, pos in reads]
        if reads and all(st is not None for st in ins):
            statics[i] = out
            for (j, _), st in zip(reads, ins, strict=True):
                statics[j] = st


def make_plan(graph: Graph, params: dict[str, torch.Tensor], target: str, buckets: tuple[int, ...] = BUCKETS,
              dot_fp32: bool = False, tuning=None, fp8_activations: bool = False) -> Plan:
    """Choose a kernel for every node that has one, its config per bucket (tuned when cached) and its
    batch-invariant config. `fp8_activations`: nodes whose lowering has a variant with e4m3 activations take it,
    and norms read only by them hand them e4m3 rows."""
    lowerings = [LOWERINGS.get(node.op) for node in graph.nodes]
    statics = [lowering.static(node, params) if lowering else None for node, lowering in zip(graph.nodes, lowerings)]
    if fp8_activations:
        statics = [st if st is None else lowering.fp8_activations(st) or st for st, lowering in zip(statics, lowerings)]
        _e4m3_rows(graph, statics)
    nodes = []
    for i, (node, lowering, static) in enumerate(zip(graph.nodes, lowerings, statics)):
        entry = NodePlan(i, node.op)
        if static is not None:
            entry.template, entry.static, entry.formats = lowering.template, static, lowering.formats(static)
            src = _template_hash(lowering.template)
            for b in buckets:
                fallback = lambda lw=lowering, st=static, b=b: lw.default_config(st, b)  # noqa: E731
                entry.configs[b], entry.sources[b] = choose(lowering.template, static, b, target, src, fallback,
                                                            tuning)
            entry.invariant = lowering.invariant(entry.config(INVARIANT_TOKENS, tuple(buckets)))
        nodes.append(entry)
    return Plan(target, nodes, tuple(buckets), dot_fp32, fp8_activations)


__all__ = ["Plan", "NodePlan", "make_plan", "bucket_of", "BUCKETS", "INVARIANT_TOKENS"]
