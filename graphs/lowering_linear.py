"""The lowerings of the linear family: `linear` and `grouped_linear`, the shared expert (`swiglu`) and the MoE gate's
projection, all on kernels/triton/linear.py; fp8 weights with e4m3 activations on kernels/triton/linear_fp8.py."""

from __future__ import annotations

import torch

import kernels.triton.linear as linear
import kernels.triton.linear_fp8 as linear_fp8
from dsl.graph import Node
from dsl.ops.moe import score
from graphs.lowering_base import Lowering, Params, meta, over_tokens, param, weight_dtype

# ---- linear and grouped_linear ---------------------------------------------------------------------------------

def _weight_format(w: torch.Tensor | None, s: torch.Tensor | None, groups: int = 1) -> str | None:
    """"fp8" (32x32 blocks), "plain" (float), or None: packed fp4 or group-scaled fp8, which the reference runs."""
    if w is None or w.dim() != 2:
        return None
    o, k = w.shape
    if w.dtype == torch.float8_e4m3fn:
        ok = s is not None and tuple(s.shape) == (-(-o // 32), -(-k // 32)) and (groups == 1 or (o // groups) % 32 == 0)
        return "fp8" if ok else None
    return "plain" if w.is_floating_point() and s is None else None


def _weight_formats(fmt: str, weights: tuple[int, ...]) -> dict[int, str]:
    """Input position -> format for weights at `weights`, each followed len(weights) places later by its scale."""
    if fmt == "fp8_rows":  # the 32x32 blocks made one scale per row at load time (graphs/executor.py)
        return {i: "fp8_rows" for i in weights} | {i + len(weights): "fp8_rows_scale" for i in weights}
    if fmt == "fp8":
        return {i: "raw" for i in weights} | {i + len(weights): "fp32" for i in weights}
    return {i: "plain" for i in weights}


def _linear_static(node: Node, params: Params) -> dict | None:
    w, s = param(node, 1, params), param(node, 2, params)
    groups = node.attrs.get("groups", 1)
    fmt = _weight_format(w, s, groups)
    if fmt is None or not over_tokens(node) or node.inputs[0].type.rank != 2:
        return None
    return {"n": w.shape[0] // groups, "k": w.shape[1], "groups": groups, "fmt": fmt}


def _linear_run(args, attrs, static, config, ctx, dot_fp32):
    x, w, s = args[0], args[1], args[2]
    if static["fmt"] == "fp8_rows":  # e4m3 activations, one scale per token: the fp8 tensor cores (exact products)
        return linear_fp8.linear_rowwise(*linear_fp8.quantize_rows(x.contiguous()), w, s, config=config)
    return linear.linear(x.contiguous(), w, s, groups=static["groups"], config=config, dot_fp32=dot_fp32)


def _linear_trace(static, attrs, config, m, dot_fp32):
    g, n, k = static["groups"], static["n"], static["k"]
    if static["fmt"] == "fp8_rows":
        return _linear_run([meta(m, k), meta(n, k, dtype=torch.float8_e4m3fn), meta(n)], {}, static, config, None, 0)
    w = meta(g * n, k, dtype=weight_dtype(static["fmt"], dot_fp32))
    s = meta(-(-g * n // 32), -(-k // 32)) if static["fmt"] == "fp8" else None
    linear.linear(meta(m, g * k), w, s, groups=g, config=config, dot_fp32=dot_fp32)


LINEAR = Lowering(
    "linear", _linear_static, lambda st: _weight_formats(st["fmt"], (1,)), _linear_run, _linear_trace,
    lambda st, m: linear_fp8.default_config(m, st["n"], st["k"]) if st["fmt"] == "fp8_rows" else
    linear.default_config(m, st["n"], st["k"], st["groups"], st["fmt"] == "fp8"),  # plain weights: bf16
    fp8_activations=lambda st: dict(st, fmt="fp8_rows") if st["fmt"] == "fp8" and st["groups"] == 1 else None)


# ---- the shared expert and the gate: their projections on the linear kernel -------------------------------------

def _swiglu_static(node: Node, params: Params) -> dict | None:
    ws = [param(node, i, params) for i in (1, 2, 3)]
    fmts = {_weight_format(w, param(node, i + 3, params)) for i, w in zip((1, 2, 3), ws, strict=True)}
    if not over_tokens(node) or len(fmts) != 1 or None in fmts:
        return None
    return {"inter": ws[0].shape[0], "d": ws[0].shape[1], "fmt": fmts.pop()}


def _swiglu_run(args, attrs, st, config, ctx, dot_fp32):
    x, w1, w2, w3, s1, s2, s3 = args
    x, limit = x.contiguous(), attrs["limit"]
    gate = linear.linear(x, w1, s1, config=config["up"], dot_fp32=dot_fp32)
    up = linear.linear(x, w3, s3, config=config["up"], dot_fp32=dot_fp32)
    if limit > 0:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    return linear.linear(torch.nn.functional.silu(gate) * up, w2, s2, config=config["down"], dot_fp32=dot_fp32)


def _swiglu_trace(st, attrs, config, m, dot_fp32):
    inter, d, fp8 = st["inter"], st["d"], st["fmt"] == "fp8"
    for n, k, part in ((inter, d, "up"), (d, inter, "down")):
        w = meta(n, k, dtype=weight_dtype(st["fmt"], dot_fp32))
        linear.linear(meta(m, k), w, meta(-(-n // 32), -(-k // 32)) if fp8 else None, config=config[part],
                      dot_fp32=dot_fp32)


SWIGLU = Lowering(
    "swiglu", _swiglu_static, lambda st: _weight_formats(st["fmt"], (1, 2, 3)), _swiglu_run, _swiglu_trace,
    lambda st, m: {"up": linear.default_config(m, st["inter"], st["d"], fp8=st["fmt"] == "fp8"),
                   "down": linear.default_config(m, st["d"], st["inter"], fp8=st["fmt"] == "fp8")})


def _gate_static(node: Node, params: Params) -> dict | None:
    w = param(node, 1, params)
    if not over_tokens(node) or _weight_format(w, None) != "plain" or param(node, 2, params) is None:
        return None
    return {"e": w.shape[0], "d": w.shape[1]}


def _gate_run(args, attrs, st, config, ctx, dot_fp32):
    """dsl.ops.moe.moe_gate with its projection on the kernel, in fp32 products as there: routing is discrete."""
    x, w, bias = args
    scores = score(linear.linear(x.contiguous(), w, config=config, dot_fp32=True) / attrs["temp"], attrs["func"])
    experts = (scores + bias).topk(attrs["topk"], dim=-1)[1]
    weights = scores.gather(1, experts)
    if attrs["normalize"] and attrs["topk"] > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * attrs["scaling"], experts


MOE_GATE = Lowering(
    "moe_gate", _gate_static, lambda st: {1: "fp32", 2: "fp32"}, _gate_run,
    lambda st, attrs, config, m, f: linear.linear(meta(m, st["d"]), meta(st["e"], st["d"]), config=config,
                                                  dot_fp32=True),
    lambda st, m: linear.default_config(m, st["e"], st["d"], w_bytes=4))


__all__ = ["LINEAR", "MOE_GATE", "SWIGLU"]
