"""The lowerings of the linear family: `linear` and `grouped_linear`, the shared expert (`swiglu`: its projections,
its clamped SwiGLU in one kernel, kernels/linear/swiglu.py) and the MoE gate's projection. Decode buckets run
kernels/linear/linear.py; prefill buckets with enough output tiles (`linear_prefill.serves`) the prefill GEMM,
kernels/linear/prefill.py (bf16 products like linear.py's, summed in another order), whose config keeps
linear.py's beside it for plans that multiply in fp32; fp8 weights with e4m3 activations run
kernels/linear/fp8.py, on rows a norm rounded already where the plan says so (`e4m3_in`, graphs/plan.py). The
gate's projection always multiplies in fp32 (routing is discrete): linear.py; its scores and top-k then run
kernels/moe/gate.py."""

from __future__ import annotations

import torch

import kernels.linear.fp8 as linear_fp8
import kernels.linear.linear as linear
import kernels.linear.prefill as linear_prefill
import kernels.linear.swiglu as swiglu
import kernels.moe.gate as moe_gate
from dsl.graph import Node
from graphs.lowering_base import Lowering, Params, meta, over_tokens, param, weight_dtype

# A projection runs the prefill GEMM in the buckets `linear_prefill.serves` gives it (enough tokens and output tiles;
# fp8 weights pay a bf16 copy a call there, 3 bytes a weight). Both GEMMs give a row the same bits padded or not, so
# a bucket CUDA graphs capture may take either: where the switch sits is a speed question, measured per shape.


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


def _config(m: int, n: int, k: int, fmt: str, groups: int = 1) -> dict:
    """A projection's heuristic config for a bucket of m tokens: linear.py's, or the prefill GEMM's with it."""
    config = linear.default_config(m, n, k, groups, fmt == "fp8")  # plain weights: bf16
    if linear_prefill.serves(m, n, groups, fmt == "fp8"):  # plain or fp8 32x32 weights: fp8_rows has its own kernel
        return {"prefill": linear_prefill.default_config(m, n, k), "linear": config}
    return config


def _project(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, config: dict, dot_fp32: bool,
             groups: int = 1) -> torch.Tensor:
    """x @ W.T (block-diagonal over `groups`) on the kernel the config names; fp32 products run linear.py."""
    if "prefill" not in config or dot_fp32:
        return linear.linear(x, w, s, groups=groups, config=config.get("linear", config), dot_fp32=dot_fp32)
    if groups == 1:
        return linear_prefill.linear_prefill(x, w, s, config=config["prefill"])
    n, k = w.shape[0] // groups, w.shape[1]  # fp8 groups hold whole 32-row scale blocks (`_weight_format`)
    return torch.cat([linear_prefill.linear_prefill(x[:, g * k:(g + 1) * k].contiguous(), w[g * n:(g + 1) * n],
                                                    None if s is None else s[g * n // 32:(g + 1) * n // 32],
                                                    config=config["prefill"]) for g in range(groups)], dim=1)


def _linear_run(args, attrs, static, config, ctx, dot_fp32):
    x, w, s = args[0], args[1], args[2]
    if static["fmt"] == "fp8_rows":  # e4m3 activations, one scale per token: the fp8 tensor cores (exact products)
        rows = linear_fp8.unpack_rows(x, static["k"]) if static.get("e4m3_in") else \
            linear_fp8.quantize_rows(x.contiguous())  # e4m3_in: a norm rounded x already (graphs/plan.py)
        return linear_fp8.linear_rowwise(*rows, w, s, config=config)
    return _project(x.contiguous(), w, s, config, dot_fp32, static["groups"])


def _linear_trace(static, attrs, config, m, dot_fp32):
    g, n, k = static["groups"], static["n"], static["k"]
    if static["fmt"] == "fp8_rows":
        x = linear_fp8.e4m3_rows(m, k, "meta")[0] if static.get("e4m3_in") else meta(m, k)
        return _linear_run([x, meta(n, k, dtype=torch.float8_e4m3fn), meta(n)], {}, static, config, None, 0)
    w = meta(g * n, k, dtype=weight_dtype(static["fmt"], dot_fp32))
    s = meta(-(-g * n // 32), -(-k // 32)) if static["fmt"] == "fp8" else None
    return _project(meta(m, g * k), w, s, config, dot_fp32, g)


LINEAR = Lowering(
    "linear", _linear_static, lambda st: _weight_formats(st["fmt"], (1,)), _linear_run, _linear_trace,
    lambda st, m: linear_fp8.default_config(m, st["n"], st["k"]) if st["fmt"] == "fp8_rows" else
    _config(m, st["n"], st["k"], st["fmt"], st["groups"]),
    fp8_activations=lambda st: dict(st, fmt="fp8_rows") if st["fmt"] == "fp8" and st["groups"] == 1 else None,
    e4m3_in=lambda st: dict(st, e4m3_in=True) if st["fmt"] == "fp8_rows" else None)


# ---- the shared expert and the gate: their projections on the linear kernel -------------------------------------

def _swiglu_static(node: Node, params: Params) -> dict | None:
    ws = [param(node, i, params) for i in (1, 2, 3)]
    fmts = {_weight_format(w, param(node, i + 3, params)) for i, w in zip((1, 2, 3), ws, strict=True)}
    if not over_tokens(node) or len(fmts) != 1 or None in fmts:
        return None
    return {"inter": ws[0].shape[0], "d": ws[0].shape[1], "fmt": fmts.pop()}


def _swiglu_run(args, attrs, st, config, ctx, dot_fp32):
    x, w1, w2, w3, s1, s2, s3 = args
    x = x.contiguous()
    gate = _project(x, w1, s1, config["up"], dot_fp32)
    up = _project(x, w3, s3, config["up"], dot_fp32)
    return _project(swiglu.swiglu(gate, up, limit=attrs["limit"]), w2, s2, config["down"], dot_fp32)


def _swiglu_trace(st, attrs, config, m, dot_fp32):
    inter, d, fp8 = st["inter"], st["d"], st["fmt"] == "fp8"
    for n, k, part in ((inter, d, "up"), (d, inter, "down")):
        w = meta(n, k, dtype=weight_dtype(st["fmt"], dot_fp32))
        _project(meta(m, k), w, meta(-(-n // 32), -(-k // 32)) if fp8 else None, config[part], dot_fp32)
    swiglu.swiglu(meta(m, inter), meta(m, inter), limit=attrs["limit"])


SWIGLU = Lowering(
    "swiglu", _swiglu_static, lambda st: _weight_formats(st["fmt"], (1, 2, 3)), _swiglu_run, _swiglu_trace,
    lambda st, m: {"up": _config(m, st["inter"], st["d"], st["fmt"]),
                   "down": _config(m, st["d"], st["inter"], st["fmt"])})


def _gate_static(node: Node, params: Params) -> dict | None:
    w = param(node, 1, params)
    if not over_tokens(node) or _weight_format(w, None) != "plain" or param(node, 2, params) is None:
        return None
    return {"e": w.shape[0], "d": w.shape[1]}


def _gate(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, attrs: dict, config: dict):
    """dsl.ops.moe.moe_gate: the projection on linear.py in fp32 products, as there (routing is discrete), then the
    scores and top-k on moe_gate.py. `config` is the projection's: the tuned one."""
    logits = linear.linear(x, w, config=config, dot_fp32=True)
    return moe_gate.gate_topk(logits, bias, **{k: attrs[k] for k in ("topk", "func", "temp", "normalize", "scaling")})


MOE_GATE = Lowering(
    "moe_gate", _gate_static, lambda st: {1: "fp32", 2: "fp32"},
    lambda args, attrs, st, config, ctx, f: _gate(args[0].contiguous(), args[1], args[2], attrs, config),
    lambda st, attrs, config, m, f: _gate(meta(m, st["d"]), meta(st["e"], st["d"]), meta(st["e"]), attrs, config),
    lambda st, m: linear.default_config(m, st["e"], st["d"], w_bytes=4))


__all__ = ["LINEAR", "MOE_GATE", "SWIGLU"]
