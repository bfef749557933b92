"""The slice benchmark's torch.compile baseline: the cpu target's ops compiled one by one (dynamic shapes), the ops
that read the caches left eager."""

from __future__ import annotations

import torch

from dsl.ops import OPS
from dsl.ops.dense import weight_values
from dsl.ops.moe import swiglu_expert

_compiled_expert = None


def compiled_moe_experts(x, weights, experts, w1, w2, w3, s1=None, s2=None, s3=None, *, limit: float):
    """The `moe_experts` reference's loop (it syncs with the host to list the experts) with each expert's
    dequantize-and-SwiGLU compiled."""
    global _compiled_expert
    if _compiled_expert is None:
        _compiled_expert = torch.compile(
            lambda xr, a, b, c, sa, sb, sc, wt: swiglu_expert(xr, weight_values(a, sa), weight_values(b, sb),
                                                              weight_values(c, sc), limit, wt), dynamic=True)
    x = x.float()
    y = torch.zeros_like(x)
    pick = (lambda s, e: None if s is None else s[e])  # noqa: E731
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        y[rows] += _compiled_expert(x[rows], w1[e], w2[e], w3[e], pick(s1, e), pick(s2, e), pick(s3, e),
                                    weights[rows, slot, None])
    return y


def compiled_kernels(graph) -> dict:
    """torch.compile per op (dynamic shapes) for the ops that are tensor functions; the ops that loop over sequences
    or read the caches (`ctx`) stay eager. Calls with a ragged argument (compressed entries) run the reference."""
    import torch._dynamo

    dyn = torch._dynamo.config  # recompiles per op: 0/1-specialised sizes, expert-slice offsets, top-k widths
    setattr(dyn, "recompile_limit" if hasattr(dyn, "recompile_limit") else "cache_size_limit", 64)
    out = {}
    for name in sorted({n.op for n in graph.nodes}):
        opdef = OPS[name]
        if opdef.uses_context or name in ("reshape", "broadcast_streams", "moe_experts"):
            continue
        # the function itself, not its Ragged-mapping wrapper: one code object shared by many ops recompiles per op
        fn = torch.compile(getattr(opdef.reference, "__wrapped__", opdef.reference), dynamic=True)
        out[name] = (lambda fn, ref: lambda *a, **kw: fn(*a, **kw) if all(
            x is None or isinstance(x, torch.Tensor) for x in a) else ref(*a, **kw))(fn, opdef.reference)
    out["moe_experts"] = compiled_moe_experts
    return out


__all__ = ["compiled_kernels"]
