"""The linear family's lowerings: `linear` and `grouped_linear`, and the shared expert (`swiglu`: its projections, its
clamped SwiGLU in one kernel, swiglu.py).

A projection runs one of three GEMMs in a bucket (`gemm_for`): the decode GEMM (linear.py); the prefill GEMM
(prefill.py: bf16 products like linear.py's, summed in another order) in the buckets `prefill.serves` gives it (enough
tokens and output tiles; fp8 weights pay a bf16 copy a call there, 3 bytes a weight) unless the plan multiplies in
fp32; and, for fp8 weights in plans with fp8 activations (`fmt` "fp8_rows"), the fp8 GEMM (fp8.py), on rows a norm
rounded already where the plan says so (`Variant.e4m3_in`). Both bf16 GEMMs give a row the same bits padded or not,
so a bucket CUDA graphs capture may take either: where the switch sits is a speed question, measured per shape. The
tuner searches the decode GEMM's configs; the prefill GEMM keeps its heuristic tiles. One token over fp8 weights runs
the decode GEMM's one-row kernel (gemv.py's `gemv_kernel`) except in batch-invariant configs (`gemv` False there:
its bits are not the tensor cores'), so a decode bucket's trace records it too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kernels.linear.fp8 as fp8
import kernels.linear.linear as linear
import kernels.linear.prefill as prefill
import kernels.linear.swiglu as swiglu
from dsl.graph import Node
from kernels.lowering import (
    PLAIN,
    Call,
    Lowering,
    Params,
    Static,
    Variant,
    meta,
    over_tokens,
    param,
    traced_counts,
    weight_dtype,
)

DECODE, PREFILL, ROWS = "decode", "prefill", "rows"  # the GEMMs of a projection


@dataclass(frozen=True)
class LinearStatic(Static):
    n: int  # output features (a group's)
    k: int  # input features (a group's)
    groups: int  # block-diagonal groups (wo_a), else 1
    fmt: str  # weights: "plain" (float), "fp8" (32x32 blocks), "fp8_rows" (one scale a row, for e4m3 activations)


@dataclass(frozen=True)
class SwigluStatic(Static):
    inter: int
    d: int
    fmt: str  # "plain" | "fp8"


def weight_format(w: torch.Tensor | None, s: torch.Tensor | None, groups: int = 1) -> str | None:
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


def gemm_for(tokens: int, n: int, groups: int, fmt: str, dot_fp32: bool) -> str:
    """The GEMM a projection of `n` outputs (a group's) over weights of format `fmt` runs for a bucket of `tokens`."""
    if fmt == "fp8_rows":
        return ROWS
    return PREFILL if not dot_fp32 and prefill.serves(tokens, n, groups, fmt == "fp8") else DECODE


def gemm_config(gemm: str, tokens: int, n: int, k: int, groups: int, fmt: str) -> dict:
    """A GEMM's heuristic config for a bucket of `tokens` (plain weights: bf16 products)."""
    if gemm == PREFILL:
        return prefill.default_config(tokens, n, k)
    if gemm == ROWS:
        return fp8.default_config(tokens, n, k)
    return linear.default_config(tokens, n, k, groups, fmt == "fp8")


def no_gemv(config: dict) -> dict:
    """A decode config's batch-invariant form: one token on the tensor cores too (`gemv` False), as every count."""
    return dict(config, gemv=False) if "split_k" in config else dict(config)  # the decode GEMM's (linear.py)


def one_row(tokens: int, gemm: str) -> tuple[int, ...]:
    """The token counts a trace of a bucket of `tokens` runs: the bucket's, and one token on the decode GEMM, which
    `linear` may run on another kernel (`linear.on_one_row`; elsewhere the one token's launch is the bucket's)."""
    return traced_counts(tokens, gemm == DECODE)


def project(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, gemm: str, config: dict, dot_fp32: bool,
            groups: int = 1) -> torch.Tensor:
    """x @ W.T (block-diagonal over `groups`) on the decode or the prefill GEMM."""
    if gemm == DECODE:
        return linear.linear(x, w, s, groups=groups, config=config, dot_fp32=dot_fp32)
    if groups == 1:
        return prefill.linear_prefill(x, w, s, config=config)
    n, k = w.shape[0] // groups, w.shape[1]  # fp8 groups hold whole 32-row scale blocks (`weight_format`)
    # each group's product copied into its columns: the values of a `torch.cat`, whose meta kernel (what
    # `deepinfer.compile`'s launch recording runs) would import torch._dynamo, most of a second
    out = torch.empty(x.shape[0], groups * n, dtype=torch.float32, device=x.device)  # linear_prefill's fp32
    for g in range(groups):
        out[:, g * n:(g + 1) * n] = prefill.linear_prefill(
            x[:, g * k:(g + 1) * k].contiguous(), w[g * n:(g + 1) * n],
            None if s is None else s[g * n // 32:(g + 1) * n // 32], config=config)
    return out


class Linear(Lowering):
    template, ops, static_type, sources = "linear", ("linear", "grouped_linear"), LinearStatic, (linear,)

    def static(self, node: Node, params: Params) -> LinearStatic | None:
        w, s = param(node, 1, params), param(node, 2, params)
        groups = node.attrs.get("groups", 1)
        fmt = weight_format(w, s, groups)
        if fmt is None or not over_tokens(node) or node.inputs[0].type.rank != 2:
            return None
        return LinearStatic(w.shape[0] // groups, w.shape[1], groups, fmt)

    def formats(self, static: LinearStatic) -> dict[int, str]:
        return _weight_formats(static.fmt, (1,))

    def gemms(self, static: LinearStatic, tokens: int, dot_fp32: bool) -> tuple[str, ...]:
        return (gemm_for(tokens, static.n, static.groups, static.fmt, dot_fp32),)

    def tunable(self, gemms: tuple[str, ...]) -> bool:
        return PREFILL not in gemms

    def default_config(self, static: LinearStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = (DECODE,)) -> dict:
        return gemm_config(gemms[0], tokens, static.n, static.k, static.groups, static.fmt)

    def invariant(self, config: dict) -> dict:
        return no_gemv(config)

    def run(self, call: Call) -> torch.Tensor:
        x, w, s = call.args[0], call.args[1], call.args[2]
        st = call.static
        if st.fmt == "fp8_rows":  # e4m3 activations, one scale per token: the fp8 tensor cores (exact products)
            rows = fp8.unpack_rows(x, st.k) if call.variant.e4m3_in else fp8.quantize_rows(x.contiguous())
            return fp8.linear_rowwise(*rows, w, s, config=call.config)
        return project(x.contiguous(), w, s, call.gemms[0], call.config, call.dot_fp32, st.groups)

    def trace(self, call: Call) -> None:
        st, m = call.static, call.tokens
        if st.fmt == "fp8_rows":
            x = fp8.e4m3_rows(m, st.k, "meta")[0] if call.variant.e4m3_in else meta(m, st.k)
            self.run(replace(call, args=(x, meta(st.n, st.k, dtype=torch.float8_e4m3fn), meta(st.n))))
            return
        w = meta(st.groups * st.n, st.k, dtype=weight_dtype(st.fmt, call.dot_fp32))
        s = meta(-(-st.groups * st.n // 32), -(-st.k // 32)) if st.fmt == "fp8" else None
        for rows in one_row(m, call.gemms[0]):
            project(meta(rows, st.groups * st.k), w, s, call.gemms[0], call.config, call.dot_fp32, st.groups)

    def fp8_activations(self, static: LinearStatic) -> LinearStatic | None:
        return replace(static, fmt="fp8_rows") if static.fmt == "fp8" and static.groups == 1 else None

    def takes_e4m3(self, static: LinearStatic) -> bool:
        return static.fmt == "fp8_rows"


class Swiglu(Lowering):
    """The shared expert: its gate and up projections, the clamped SwiGLU, its down projection."""

    template, ops, static_type, sources = "swiglu", ("swiglu",), SwigluStatic, (linear,)

    def static(self, node: Node, params: Params) -> SwigluStatic | None:
        ws = [param(node, i, params) for i in (1, 2, 3)]
        fmts = {weight_format(w, param(node, i + 3, params)) for i, w in zip((1, 2, 3), ws, strict=True)}
        if not over_tokens(node) or len(fmts) != 1 or None in fmts:
            return None
        return SwigluStatic(ws[0].shape[0], ws[0].shape[1], fmts.pop())

    def formats(self, static: SwigluStatic) -> dict[int, str]:
        return _weight_formats(static.fmt, (1, 2, 3))

    def gemms(self, static: SwigluStatic, tokens: int, dot_fp32: bool) -> tuple[str, ...]:
        """(up and gate's GEMM, down's GEMM)."""
        return (gemm_for(tokens, static.inter, 1, static.fmt, dot_fp32),
                gemm_for(tokens, static.d, 1, static.fmt, dot_fp32))

    def tunable(self, gemms: tuple[str, ...]) -> bool:
        return PREFILL not in gemms

    def default_config(self, static: SwigluStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = (DECODE, DECODE)) -> dict:
        return {"up": gemm_config(gemms[0], tokens, static.inter, static.d, 1, static.fmt),
                "down": gemm_config(gemms[1], tokens, static.d, static.inter, 1, static.fmt)}

    def invariant(self, config: dict) -> dict:
        return {part: no_gemv(c) for part, c in config.items()}

    def run(self, call: Call) -> torch.Tensor:
        x, w1, w2, w3, s1, s2, s3 = call.args
        (up, down), config, f = call.gemms, call.config, call.dot_fp32
        h = self._h(x.contiguous(), w1, s1, w3, s3, up, config["up"], f, call.attrs["limit"])
        return project(h, w2, s2, down, config["down"], f)

    @staticmethod
    def _h(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor | None, w3: torch.Tensor, s3: torch.Tensor | None,
           gemm: str, config: dict, dot_fp32: bool, limit: float) -> torch.Tensor:
        """The activation h: one launch for a token on the one-row kernels (`swiglu_one_row`), else the gate and up
        projections, then the clamped SwiGLU."""
        if gemm == DECODE and linear.on_one_row(x.shape[0], w1, config, dot_fp32):
            return swiglu.swiglu_one_row(x, w1, s1, w3, s3, limit=limit)
        gate, value = project(x, w1, s1, gemm, config, dot_fp32), project(x, w3, s3, gemm, config, dot_fp32)
        return swiglu.swiglu(gate, value, limit=limit)

    def trace(self, call: Call) -> None:
        st, (up, down), f = call.static, call.gemms, call.dot_fp32

        def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            return (meta(n, k, dtype=weight_dtype(st.fmt, f)),
                    meta(-(-n // 32), -(-k // 32)) if st.fmt == "fp8" else None)
        (w13, s13), (w2, s2) = weight(st.inter, st.d), weight(st.d, st.inter)
        for rows in one_row(call.tokens, up):
            self._h(meta(rows, st.d), w13, s13, w13, s13, up, call.config["up"], f, call.attrs["limit"])
        for rows in one_row(call.tokens, down):
            project(meta(rows, st.inter), w2, s2, down, call.config["down"], f)


LINEAR, SWIGLU = Linear(), Swiglu()
LOWERINGS = (LINEAR, SWIGLU)

__all__ = ["DECODE", "LINEAR", "LOWERINGS", "PREFILL", "ROWS", "SWIGLU", "LinearStatic", "SwigluStatic", "gemm_config",
           "gemm_for", "project", "weight_format"]
