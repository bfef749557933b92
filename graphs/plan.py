"""The plan: for every node of a model graph, the kernel that runs it (or its reference) and, per token-count bucket,
the GEMMs and the tuned or heuristic config, plus one batch-invariant config for every token count. Saved as
plan.json; the graph itself is rebuilt from the model. graphs/passes/ makes it (`make_plan`).

Batch invariance (`batch_invariant=True`): a row's result must not depend on the other rows or their number. A
kernel's reduction order is fixed by its config (tiles, split-K count and ranges, warps, stages) and, in sparse
attention, by how a token's entries are split; the rows themselves never meet in a reduction. So one config per
node serves every token count: the one chosen for `INVARIANT_TOKENS` (decode batches, where the mode is mostly
used), made invariant by its lowering (`Lowering.invariant`: attention keeps a token's entries in one part, since
its split sizes follow the batch's widest entry list).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dsl.graph import Graph
from kernels.lowering import Call, Static, Variant
from kernels.registry import LOWERINGS

FORMAT = 2  # plan.json's layout: a plan of another is refused
BUCKETS = (16, 64, 512, 8192)  # token-count buckets: a bucket's config serves every count up to it (and beyond
# the last); decode batches fall in the first two
INVARIANT_TOKENS = 64  # the token count whose config, made invariant, serves every count in batch-invariant runs


def bucket_of(m: int, buckets: tuple[int, ...] = BUCKETS) -> int:
    return next((b for b in buckets if m <= b), buckets[-1])


@dataclass(frozen=True)
class BucketPlan:
    """What runs a kernel node for the token counts of one bucket: the GEMMs of its projections (the linear family's:
    "decode", "prefill" or "rows"; none for the others), its config, and where the config came from ("tuned" or
    "heuristic")."""

    config: dict
    source: str = "heuristic"
    gemms: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"config": self.config, "source": self.source, "gemms": list(self.gemms)}

    @classmethod
    def from_json(cls, d: dict) -> BucketPlan:
        return cls(d["config"], d["source"], tuple(d["gemms"]))


@dataclass
class NodePlan:
    index: int
    op: str
    template: str | None = None  # None: the DSL reference runs it
    static: Static | None = None
    variant: Variant = field(default_factory=Variant)
    formats: dict[int, str] = field(default_factory=dict)
    buckets: dict[int, BucketPlan] = field(default_factory=dict)
    invariant: BucketPlan | None = None  # the batch-invariant one, for every token count

    def at(self, m: int, buckets: tuple[int, ...], batch_invariant: bool = False) -> BucketPlan:
        """What serves `m` tokens: the bucket's plan, or the batch-invariant one."""
        return self.invariant if batch_invariant else self.buckets[bucket_of(m, buckets)]

    def call(self, chosen: BucketPlan, attrs: dict, dot_fp32: bool, args=(), ctx: Any = None, tokens: int = 0) -> Call:
        """The lowering's call for one bucket's plan (`chosen`)."""
        return Call(self.static, self.variant, chosen.config, attrs, dot_fp32, chosen.gemms, args, ctx, tokens)

    def to_json(self) -> dict:
        d = {"index": self.index, "op": self.op, "template": self.template}
        if self.template:
            d |= {"static": self.static.fields(), "variant": asdict(self.variant),
                  "formats": {str(k): v for k, v in self.formats.items()},
                  "buckets": {str(b): p.to_json() for b, p in self.buckets.items()},
                  "invariant": self.invariant.to_json()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> NodePlan:
        if not d.get("template"):
            return cls(d["index"], d["op"])
        return cls(d["index"], d["op"], d["template"], LOWERINGS[d["op"]].static_type(**d["static"]),
                   Variant(**d["variant"]), {int(k): v for k, v in d["formats"].items()},
                   {int(b): BucketPlan.from_json(p) for b, p in d["buckets"].items()},
                   BucketPlan.from_json(d["invariant"]))

    def __str__(self) -> str:
        if not self.template:
            return f"{self.index:4d} {self.op}: reference"
        v = self.variant
        forms = "".join(f" {name}" for name, on in (("e4m3_out", v.e4m3_out), ("e4m3_in", v.e4m3_in)) if on)
        buckets = ", ".join(f"{b} {'/'.join(p.gemms) + ' ' if p.gemms else ''}{p.source}"
                            for b, p in self.buckets.items())
        return f"{self.index:4d} {self.op}: {self.template} {self.static} {v.backend}{forms} [{buckets}]"


@dataclass
class Plan:
    target: str
    nodes: list[NodePlan]
    buckets: tuple[int, ...] = BUCKETS
    dot_fp32: bool = False
    fp8_activations: bool = False  # linears over fp8 weights round their activations to e4m3 (the fp8 GEMM)

    def kernel_nodes(self) -> list[NodePlan]:
        return [n for n in self.nodes if n.template]

    def to_json(self) -> dict:
        return {"format": FORMAT, "target": self.target, "buckets": list(self.buckets), "dot_fp32": self.dot_fp32,
                "fp8_activations": self.fp8_activations, "nodes": [n.to_json() for n in self.nodes]}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        if d.get("format") != FORMAT:
            raise ValueError(f"the plan's format is {d.get('format', 1)}, this build reads {FORMAT}: compile the "
                             "model again")
        return cls(d["target"], [NodePlan.from_json(n) for n in d["nodes"]], tuple(d["buckets"]), d["dot_fp32"],
                   d["fp8_activations"])

    def check_graph(self, graph: Graph) -> None:
        """The plan was made for this graph: same ops in the same order."""
        ops = [n.op for n in graph.nodes]
        if ops != [n.op for n in self.nodes]:
            raise ValueError("the plan does not match the model's graph (different ops or order): recompile")

    def __str__(self) -> str:
        head = f"plan {self.target} buckets {list(self.buckets)} dot_fp32={self.dot_fp32} " \
               f"fp8_activations={self.fp8_activations}"
        return "\n".join([head] + [str(n) for n in self.nodes])


__all__ = ["BUCKETS", "FORMAT", "INVARIANT_TOKENS", "BucketPlan", "NodePlan", "Plan", "bucket_of"]
