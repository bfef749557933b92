"""Prefill GEMM benchmarks at the V4.1-Flash shapes (bench/bench_kernels.py's `--only prefill_gemm`): linear.py
against cuBLAS and `_scaled_mm`, the prefill GEMM (kernels/linear/prefill.py) and the fp8-activation path
(kernels/linear/fp8.py) against them, on the same operands."""

from __future__ import annotations

import torch
from bench_rows import FP8_TFLOPS, LINEARS, record

import kernels.linear.fp8 as linear_fp8
import kernels.linear.linear as linear
import kernels.linear.prefill as linear_prefill
from autotune.tune import time_us
from dsl.quant import dequantize_fp8_block, quantize_fp8_block
from kernels.linear.lowering import DECODE, PREFILL, project


def bench_prefill_gemm(m: int = 4096) -> None:
    for name, n, k, g in [LINEARS[1], LINEARS[4]]:
        w = torch.randn(n, k, device="cuda") * k**-0.5
        x = torch.randn(m, k, device="cuda")
        xb, wb = x.bfloat16(), w.bfloat16()
        ours = time_us(lambda: linear.linear(xb, wb))
        base = time_us(lambda: xb @ wb.t())
        record("linear bf16 prefill", f"{name} {n}x{k} M={m}", ours, flops=2 * m * n * k, base="cuBLAS bf16",
               base_us=base)
        q, s = quantize_fp8_block(w)
        ours = time_us(lambda: linear.linear(xb, q, s))
        xq = xb.to(torch.float8_e4m3fn)
        one_a, one_b = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        base = time_us(lambda: torch._scaled_mm(xq, q.t(), scale_a=one_a, scale_b=one_b, out_dtype=torch.bfloat16))
        record("linear fp8 32x32 prefill", f"{name} {n}x{k} M={m}", ours, flops=2 * m * n * k,
               base="_scaled_mm rowwise", base_us=base, ceiling_tflops=FP8_TFLOPS)
        bench_prefill_fp8_rowwise(name, q, s, old_us=ours, tokens=[1024, m, 8192])
        bench_prefill_bf16(name, wb, q, s, tokens=[1024, m, 8192])


def bench_prefill_switch(tokens: tuple[int, ...] = (128, 256, 512, 1024)) -> None:
    """Where plans should hand linears to the prefill GEMM (`linear_prefill.serves`): at each token count, each V4.1
    linear run as plans run it (`kernels.linear.lowering.project`: fp32 x in, a grouped weight one GEMM a group),
    with plain and fp8 32x32 weights, on the prefill GEMM (its heuristic tile) against linear.py (its heuristic:
    the tuning file has no entry over 64 tokens for linears)."""
    for name, n, k, g in LINEARS:
        w = torch.randn(g * n, k, device="cuda") * k**-0.5
        q, s = quantize_fp8_block(w)
        wb = w.bfloat16()
        for m in tokens:
            x = torch.randn(m, g * k, device="cuda")
            for fmt, weight, scale in (("bf16", wb, None), ("fp8 32x32", q, s)):
                lin = linear.default_config(m, n, k, g, scale is not None)
                pre = linear_prefill.default_config(m, n, k)
                record(f"prefill GEMM {fmt}", f"{name} {g}x{n}x{k} M={m}",
                       time_us(lambda: project(x, weight, scale, PREFILL, pre, False, g)), flops=2 * m * g * n * k,
                       base="linear.linear", base_us=time_us(lambda: project(x, weight, scale, DECODE, lin, False, g)))
        del w, q, s, wb


def bench_prefill_bf16(name: str, wb: torch.Tensor, q: torch.Tensor, s: torch.Tensor, tokens: list[int]) -> None:
    """The exact-path prefill GEMM (kernels/linear/prefill.py) on bf16 operands, against cuBLAS (bf16 out) and
    `linear.linear`; with fp8 32x32 weights (the bf16 expansion included) against `linear.linear`; the expansion
    alone (a byte read and two written per weight)."""
    n, k = wb.shape
    wq = dequantize_fp8_block(q, s).bfloat16()  # [N, K]: the fp8 weight's exact bf16 values
    for m in tokens:
        xb = torch.randn(m, k, device="cuda").bfloat16()
        shape, flops = f"{name} {n}x{k} M={m}", 2 * m * n * k
        for w, scale, values in [(wb, None, wb), (q, s, wq)]:
            want = xb.float() @ values.float().t()  # cuBLAS fp32 on the same bf16 operands: exact products, as ours
            err = float((linear_prefill.linear_prefill(xb, w, scale) - want).norm() / want.norm())
            if not err < 1e-3:
                raise AssertionError(f"linear_prefill {shape} {w.dtype} differs from cuBLAS: rel L2 {err:.1e}")
        del want
        ours = time_us(lambda: linear_prefill.linear_prefill(xb, wb))
        record("linear prefill bf16", shape, ours, flops=flops, base="cuBLAS bf16",
               base_us=time_us(lambda: xb @ wb.t()))
        record("linear prefill bf16", shape, ours, flops=flops, base="linear.linear bf16",
               base_us=time_us(lambda: linear.linear(xb, wb)))
        record("linear prefill fp8 32x32", shape, time_us(lambda: linear_prefill.linear_prefill(xb, q, s)),
               flops=flops, base="linear.linear fp8 32x32", base_us=time_us(lambda: linear.linear(xb, q, s)))
    record("dequantize_weight", f"{name} {n}x{k}", time_us(lambda: linear_prefill.dequantize_weight(q, s)),
           nbytes=3 * n * k + s.numel() * 4, base="torch (ref)",
           base_us=time_us(lambda: dequantize_fp8_block(q, s).bfloat16(), graph=False))  # events: may synchronize


def bench_prefill_fp8_rowwise(name: str, q: torch.Tensor, s: torch.Tensor, old_us: float, tokens: list[int]) -> None:
    """The fp8-activation path (kernels/linear/fp8.py): per-token e4m3 x, rowwise weight, one fp8 GEMM,
    against `_scaled_mm` on the same operands; the quantization alone; and both together against the 32x32 kernel."""
    (n, k), (wq, sw) = q.shape, linear_fp8.rowwise_weight(q, s)
    for m in tokens:
        x = torch.randn(m, k, device="cuda")
        xq, sx = linear_fp8.quantize_rows(x)
        shape = f"{name} {n}x{k} M={m}"
        ours = lambda: linear_fp8.linear_rowwise(xq, sx, wq, sw, out_dtype=torch.bfloat16)  # noqa: E731
        base = lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None], scale_b=sw[None, :],  # noqa: E731
                                        out_dtype=torch.bfloat16)
        err = float((ours().float() - base().float()).norm() / base().float().norm())
        if not err < 1e-2:
            raise AssertionError(f"linear_rowwise {shape} differs from _scaled_mm: rel L2 {err:.1e}")
        fast = lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx[:, None], scale_b=sw[None, :],  # noqa: E731
                                        out_dtype=torch.bfloat16, use_fast_accum=True)
        ours_us = time_us(ours)
        record("linear fp8 rowwise prefill", shape, ours_us, flops=2 * m * n * k, base="_scaled_mm rowwise",
               base_us=time_us(base), ceiling_tflops=FP8_TFLOPS)
        # like for like: our default leaves the whole K to the tensor cores' accumulation, as fast accumulation does
        record("linear fp8 rowwise prefill", shape, ours_us, flops=2 * m * n * k, base="_scaled_mm fast accum",
               base_us=time_us(fast), ceiling_tflops=FP8_TFLOPS)
        record("quantize_rows", f"{m}x{k} fp32", time_us(lambda: linear_fp8.quantize_rows(x)),
               nbytes=m * k * 5 + m * 4, base="torch eager (ref)",
               base_us=time_us(lambda: linear_fp8.quantize_rows_ref(x)))
        if m == tokens[1]:
            both = time_us(lambda: linear_fp8.linear_rowwise(*linear_fp8.quantize_rows(x), wq, sw,
                                                             out_dtype=torch.bfloat16))
            record("quantize + fp8 rowwise", shape, both, flops=2 * m * n * k, base="linear fp8 32x32 prefill",
                   base_us=old_us, ceiling_tflops=FP8_TFLOPS)


__all__ = ["bench_prefill_gemm", "bench_prefill_switch"]
