"""Which kernel serves a DSL node, and how: one `Lowering` per op that has a kernel.

A lowering reads a node and the weights to decide whether its kernel applies and with which static shapes
(`static`: the tuning key's weight-fixed dims), names the weight formats the kernel wants (`formats`), runs the
kernel on the node's runtime arguments (`run`), makes meta-tensor arguments of a bucket's token count for the
ahead-of-time builder (`trace`), and turns a config into its batch-invariant form (`invariant`; graphs/plan.py).
RMSNorm, rope and the cache roundings also run over the compressed entries a forward completes (a `Ragged`, flat
over E).
Nodes without a lowering, or not flat over N (or E, for those), run their DSL reference on the device. RMSNorm's
kernel, and the hyper-connections' collapse + RMSNorm's, are TileLang's (kernels/tilelang/) where TileLang kernels
can be built (tilelang and nvcc installed: the static shapes say `"kernel": "tilelang"`), else Triton's; the GPU
machine runs either from cubins. Where a plan with fp8 activations has only fp8-activation linears read a norm, the
norm is the variant that writes e4m3 rows for them (kernels/norm/e4m3.py; `e4m3_out`, graphs/plan.py). The
linear family's lowerings are in graphs/lowering_linear.py (a plan with fp8 activations gives fp8-weight linears their
e4m3-input variant there), the attention's and the indexer's in graphs/lowering_attention.py, the record and shared
helpers in graphs/lowering_base.py.
"""

from __future__ import annotations

import torch

import kernels.compressor.pool as compressor
import kernels.engram.gate as engram
import kernels.engram.hash_rows as engram_rows
import kernels.hyper.collapse_tilelang as hyper_tilelang
import kernels.hyper.hyper as hyper
import kernels.moe.experts as moe
import kernels.norm.e4m3 as norm_e4m3
import kernels.norm.rms_norm as rms_norm
import kernels.norm.rms_norm_tilelang as rms_norm_tilelang
import kernels.rope.rope as rope
import kernels.rounding.rounding as rounding
from dsl.graph import Node
from dsl.ops.compressor import pool_entries
from dsl.ops.rope import _freqs_on, inv_freq
from dsl.tensor import num_tokens
from graphs.lowering_attention import CANDIDATE_BLOCKS, INDEX_SCORES, SPARSE_ATTENTION, TOPK_SELECT
from graphs.lowering_base import Lowering, Params, meta, over_rows, over_tokens, param, weight_dtype
from graphs.lowering_linear import LINEAR, MOE_GATE, SWIGLU
from kernels.tilelang_build import available as tilelang_available

# ---- rms_norm ----------------------------------------------------------------------------------------------------

def _norm_static(node: Node, params: Params) -> dict | None:
    if not over_rows(node) or (node.inputs[1] is not None and param(node, 1, params) is None):
        return None
    return {"d": int(node.inputs[0].type.shape[-1]), "has_w": node.inputs[1] is not None,
            "eps": node.attrs["eps"], "kernel": _kernel()}


def _kernel() -> str:
    """Which kernel serves the ops that have both: a plan built where TileLang cannot build runs Triton's."""
    return "tilelang" if tilelang_available() else "triton"


def _norm_module(static: dict):
    return rms_norm_tilelang if static.get("kernel") == "tilelang" else rms_norm  # no "kernel": an older plan's Triton


def _norm(static: dict, x: torch.Tensor, w: torch.Tensor | None, eps: float, config: dict) -> torch.Tensor:
    if static.get("e4m3_out"):  # read only by fp8-activation linears: e4m3 rows for them (graphs/plan.py)
        return norm_e4m3.rms_norm_e4m3(x, w, eps=eps, config=config)
    return _norm_module(static).rms_norm(x, w, eps=eps, config=config)


def _norm_trace(static, attrs, config, m, dot_fp32):
    _norm(static, meta(m, static["d"]), meta(static["d"]) if static["has_w"] else None, static["eps"], config)


RMS_NORM = Lowering(
    "rms_norm", _norm_static, lambda st: {1: "fp32"},
    lambda args, attrs, st, config, ctx, f: _norm(st, args[0].contiguous(), args[1], attrs["eps"], config),
    _norm_trace, lambda st, m: _norm_module(st).default_config(st["d"]),
    e4m3_out=lambda st: dict(st, kernel="triton", e4m3_out=True))  # the fused rounding is Triton's


# ---- hyper-connections -------------------------------------------------------------------------------------------

def _hc_static(node: Node, params: Params) -> dict | None:
    t = node.inputs[1].type if node.op == "hc_expand" else node.inputs[0].type
    if t is None or t.rank != 3 or t.shape[0] != num_tokens:
        return None
    return {"hc": int(t.shape[1]), "d": int(t.shape[2])}


def _mixes_run(args, attrs, st, config, ctx, dot_fp32):
    return hyper.hc_mixes(args[0].contiguous(), *args[1:4], iters=attrs["iters"], eps=attrs["eps"],
                          norm_eps=attrs["norm_eps"], config=config)


def _mixes_trace(st, attrs, config, m, dot_fp32):
    hc, d = st["hc"], st["d"]
    nout = (2 + hc) * hc
    hyper.hc_mixes(meta(m, hc, d), meta(nout, hc * d), meta(3), meta(nout), iters=attrs["iters"],
                   eps=attrs["eps"], norm_eps=attrs["norm_eps"], config=config)


HC_MIXES = Lowering("hc_mixes", _hc_static, lambda st: {1: "fp32", 2: "fp32", 3: "fp32"}, _mixes_run,
                    _mixes_trace, lambda st, m: hyper.mixes_config(m, st["hc"] * st["d"]))


def _collapse_static(node: Node, params: Params) -> dict | None:
    static = _hc_static(node, params)
    return None if static is None else static | {"kernel": _kernel()}


def _collapse(static: dict, h, pre, w, eps: float, config: dict):
    if static.get("e4m3_out"):
        return norm_e4m3.hc_collapse_rms_norm_e4m3(h, pre, w, eps=eps)
    if static.get("kernel") == "tilelang":
        return hyper_tilelang.hc_collapse_rms_norm(h, pre, w, eps=eps, config=config)
    return hyper.hc_collapse_rms_norm(h, pre, w, eps=eps)  # no "kernel": an older plan's Triton


def _collapse_run(args, attrs, st, config, ctx, dot_fp32):
    h, pre, w = args[0].contiguous(), args[1], args[2]
    if pre.dim() == 1:  # the first site's one-hot `hc_stream0` [hc], the same for every token
        pre = pre.float().expand(h.shape[0], -1)
    return _collapse(st, h, pre.contiguous(), w, attrs["eps"], config)


HC_COLLAPSE_RMS_NORM = Lowering(
    "hc_collapse_rms_norm", _collapse_static, lambda st: {2: "fp32"}, _collapse_run,
    lambda st, attrs, config, m, f: _collapse(st, meta(m, st["hc"], st["d"]), meta(m, st["hc"]), meta(st["d"]),
                                              attrs["eps"], config),
    lambda st, m: rms_norm_tilelang.default_config(st["d"]) if st.get("kernel") == "tilelang" else {},
    e4m3_out=lambda st: dict(st, kernel="triton", e4m3_out=True))

HC_EXPAND = Lowering(
    "hc_expand", _hc_static, lambda st: {},
    lambda args, attrs, st, config, ctx, f: hyper.hc_expand(*(a.contiguous() for a in args)),
    lambda st, attrs, config, m, f: hyper.hc_expand(meta(m, st["d"]), meta(m, st["hc"], st["d"]), meta(m, st["hc"]),
                                            meta(m, st["hc"], st["hc"])),
    lambda st, m: {})


def _engram_static(node: Node, params: Params) -> dict | None:
    static = _hc_static(node, params)
    kv = node.inputs[1].type
    if static is None or node.inputs[0].type.dtype != "float32" or kv is None or kv.dtype != "float32":
        return None
    return static


ENGRAM_GATE = Lowering(
    "engram_gate", _engram_static, lambda st: {2: "fp32", 3: "fp32"},
    lambda args, attrs, st, config, ctx, f: engram.engram_gate(args[0].contiguous(), args[1].contiguous(), args[2],
                                                               args[3], eps=attrs["eps"]),
    lambda st, attrs, config, m, f: engram.engram_gate(meta(m, st["hc"], st["d"]), meta(m, (st["hc"] + 1) * st["d"]),
                                                       meta(st["hc"], st["d"]), meta(st["hc"], st["d"]),
                                                       eps=attrs["eps"]),
    lambda st, m: {})


def _hash_rows_static(node: Node, params: Params) -> dict | None:
    """The table's dtype as it is stored (no copy of a table of hundreds of millions of rows), fp8 with its scales
    ("scaled": a float scale, made fp32 once) or without (its codes, as the reference)."""
    ngrams, table, scale = node.inputs[0].type, param(node, 1, params), param(node, 2, params)
    if ngrams.dtype != "int64" or ngrams.rank != 2 or ngrams.shape[0] != num_tokens or table is None \
            or table.dim() != 2 or table.dtype not in engram_rows.TABLE_DTYPES:
        return None
    rows, d = table.shape
    scaled = table.dtype == torch.float8_e4m3fn and node.inputs[2] is not None
    if scaled and (scale is None or not scale.is_floating_point() or tuple(scale.shape) != (rows, -(-d // 32))):
        return None
    return {"n": int(ngrams.shape[1]), "rows": rows, "d": d, "dtype": str(table.dtype).removeprefix("torch."),
            "scaled": scaled}


def _hash_rows(st: dict, attrs: dict, config: dict, ngrams, table, scale):
    return engram_rows.engram_hash_rows(ngrams, table, scale if st["scaled"] else None, **attrs, config=config)


def _hash_rows_trace(st, attrs, config, m, dot_fp32):
    rows, d = st["rows"], st["d"]
    _hash_rows(st, attrs, config, meta(m, st["n"], dtype=torch.int64),
               meta(rows, d, dtype=getattr(torch, st["dtype"])), meta(rows, -(-d // 32)))


ENGRAM_HASH_ROWS = Lowering(
    "engram_hash_rows", _hash_rows_static, lambda st: {1: "raw", 2: "fp32"} if st["scaled"] else {1: "raw"},
    lambda args, attrs, st, config, ctx, f: _hash_rows(st, attrs, config, args[0].contiguous(), args[1], args[2]),
    _hash_rows_trace, lambda st, m: engram_rows.default_config(m, st["d"]))


# ---- rotary embedding --------------------------------------------------------------------------------------------

def _rope_static(node: Node, params: Params) -> dict | None:
    t = node.inputs[0].type
    if not over_tokens(node) or any(not isinstance(s, int) for s in t.shape[1:]):
        return None
    rows = 1
    for s in t.shape[1:-1]:
        rows *= s
    return {"rows": rows, "d": int(t.shape[-1])}


def _rope(x: torch.Tensor, positions: torch.Tensor, attrs: dict, config: dict) -> torch.Tensor:
    rope_dim = attrs["rope_dim"]
    return rope.rope(x, positions, _freqs_on(attrs["params"], rope_dim, x.device),
                     magnitude=inv_freq(attrs["params"], rope_dim)[1], inverse=attrs.get("inverse", False),
                     config=config)


ROPE = Lowering(
    "rope", _rope_static, lambda st: {},
    lambda args, attrs, st, config, ctx, f: _rope(args[0].contiguous(), ctx.positions, attrs, config),
    lambda st, attrs, config, m, f: _rope(meta(m, st["rows"], st["d"]), meta(m, dtype=torch.int64), attrs, config),
    lambda st, m: rope.default_config(st["rows"], st["d"]))


def _entries_static(node: Node, params: Params) -> dict | None:
    t = node.inputs[0].type
    if not over_rows(node) or t.rank != 2 or not isinstance(t.shape[-1], int):
        return None
    return {"rows": 1, "d": int(t.shape[-1])}


def _rope_entries(args, attrs, st, config, ctx, f):
    """dsl.ops.rope.rope_entries on the rope kernel: entry j of ratio r at position j * r, made once per layout."""
    x = args[0]
    if not x.values.shape[0]:
        return x
    key = ("entry positions", attrs["ratio"], tuple(x.first), tuple(x.counts))
    positions = ctx.memo(key, lambda: ctx.entry_layout(x.first, x.counts)[3] * attrs["ratio"])
    return x.replace(_rope(x.values.contiguous(), positions, attrs, config))


ROPE_ENTRIES = Lowering(  # the rope kernel over compressed entries: its template, configs and cubins
    "rope", _entries_static, lambda st: {}, _rope_entries,
    lambda st, attrs, config, m, f: _rope(meta(m, st["d"]), meta(m, dtype=torch.int64), attrs, config),
    lambda st, m: rope.default_config(st["rows"], st["d"]), ragged=True)


# ---- the compressor ----------------------------------------------------------------------------------------------

def _pool_static(node: Node, params: Params) -> dict | None:
    t = node.inputs[0].type
    if node.attrs["ratio"] == 1 or not over_tokens(node) or t.rank != 2 or node.inputs[1] is None:
        return None
    return {"d": int(t.shape[-1]), "ratio": int(node.attrs["ratio"])}


def _pool_run(args, attrs, st, config, ctx, f):
    return pool_entries(args[0], args[1], layer=attrs["layer"], ratio=attrs["ratio"], ctx=ctx,
                        pool_groups=lambda *a: compressor.pool_groups(*a, config=config))


COMPRESS_POOL = Lowering(  # the completed groups on the kernel; the partial rows' reads and writes as they were
    "compress_pool", _pool_static, lambda st: {}, _pool_run,
    lambda st, attrs, config, m, f: compressor.pool_groups(*(meta(m, st["d"]) for _ in range(4)),
                                                           meta(m, st["ratio"], dtype=torch.int64), config=config),
    lambda st, m: compressor.default_config(st["d"]))


# ---- routed experts ----------------------------------------------------------------------------------------------

def _moe_static(node: Node, params: Params) -> dict | None:
    w1 = param(node, 3, params)
    if w1 is None or not over_tokens(node) or w1.dim() != 3:
        return None
    fp4 = w1.dtype == torch.uint8
    e, inter, k = w1.shape
    d = 2 * k if fp4 else k
    if not (fp4 or w1.is_floating_point()) or (fp4 and (d % 32 or inter % 32)):
        return None
    return {"e": e, "inter": inter, "d": d, "topk": int(node.inputs[2].type.shape[1]), "fmt": "fp4" if fp4 else "plain"}


def _moe_run(args, attrs, st, config, ctx, dot_fp32):
    x, weights, experts, w1, w2, w3, s1, s2, s3 = args
    return moe.moe_experts(x.contiguous(), weights.float().contiguous(), experts.contiguous(), w1, w2, w3, s1, s2,
                           s3, limit=attrs["limit"], config=config, dot_fp32=dot_fp32)


def _moe_trace(st, attrs, config, m, dot_fp32):
    e, inter, d, fp4 = st["e"], st["inter"], st["d"], st["fmt"] == "fp4"
    wd = weight_dtype(st["fmt"], dot_fp32)
    w1 = meta(e, inter, d // 2 if fp4 else d, dtype=wd)
    w2 = meta(e, d, inter // 2 if fp4 else inter, dtype=wd)
    s1, s2 = (meta(e, inter, d // 32, dtype=torch.bfloat16), meta(e, d, inter // 32, dtype=torch.bfloat16)) if fp4 \
        else (None, None)
    moe.moe_experts(meta(m, d), meta(m, st["topk"]), meta(m, st["topk"], dtype=torch.int64), w1, w2, w1, s1, s2,
                    s1, limit=attrs["limit"], config=config, dot_fp32=dot_fp32)


MOE_EXPERTS = Lowering(
    "moe_experts", _moe_static,
    lambda st: {3: "raw", 4: "raw", 5: "raw", 6: "prescaled", 7: "prescaled", 8: "prescaled"} if st["fmt"] == "fp4"
    else {3: "plain", 4: "plain", 5: "plain"},
    _moe_run, _moe_trace, lambda st, m: moe.default_config(m, st["fmt"] == "fp4"))


# ---- cache rounding: fp8 and fp4 grids ---------------------------------------------------------------------------

def _rounding_static(node: Node, params: Params) -> dict | None:
    """None where the last dim is not a multiple of the block: the reference returns x unchanged."""
    block = node.attrs.get("block", 32)  # fp8_round's default
    if not over_rows(node) or int(node.inputs[0].type.shape[-1]) % block:
        return None
    fp4 = {"e4m3_scale": bool(node.attrs["e4m3_scale"])} if node.op == "fp4_round" else {}
    return {"d": int(node.inputs[0].type.shape[-1]), "block": block} | fp4


def _round(static: dict, x: torch.Tensor, config: dict) -> torch.Tensor:
    """fp4 when the static shapes name a scale kind, else fp8."""
    fp4 = {"e4m3_scale": static["e4m3_scale"]} if "e4m3_scale" in static else None
    kernel = rounding.fp8_round if fp4 is None else rounding.fp4_round
    return kernel(x.contiguous(), block=static["block"], config=config, **(fp4 or {}))


FP8_ROUND, FP4_ROUND = (Lowering(template, _rounding_static, lambda st: {},
                                 lambda args, attrs, st, config, ctx, f: _round(st, args[0], config),
                                 lambda st, attrs, config, m, f: _round(st, meta(m, st["d"]), config),
                                 lambda st, m: rounding.default_config(st["block"]))
                        for template in ("fp8_round", "fp4_round"))

LOWERINGS: dict[str, Lowering] = {
    "linear": LINEAR, "grouped_linear": LINEAR, "rms_norm": RMS_NORM, "hc_mixes": HC_MIXES,
    "hc_collapse_rms_norm": HC_COLLAPSE_RMS_NORM, "hc_expand": HC_EXPAND, "engram_gate": ENGRAM_GATE,
    "engram_hash_rows": ENGRAM_HASH_ROWS,
    "rope": ROPE, "rope_entries": ROPE_ENTRIES, "compress_pool": COMPRESS_POOL, "moe_experts": MOE_EXPERTS,
    "swiglu": SWIGLU, "moe_gate": MOE_GATE, "sparse_attention": SPARSE_ATTENTION,
    "index_scores": INDEX_SCORES, "topk_select": TOPK_SELECT, "candidate_blocks": CANDIDATE_BLOCKS,
    "fp8_round": FP8_ROUND, "fp4_round": FP4_ROUND,
}

__all__ = ["Lowering", "LOWERINGS"]
