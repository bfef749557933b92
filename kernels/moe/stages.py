"""One K stage of the fp4 grouped GEMMs, the pieces both product loops share (experts.py's `_fp4_products` on raw
codes, fragments.py's `fragment_products` on codes in fragment order): the activations' even and odd input columns,
the two products a weight makes with them, and the wait that ends a stage.
"""

from __future__ import annotations

from kernels.lang import tl, triton


@triton.jit
def activations(xa, KP: tl.constexpr, mask_x, DOT_FP32: tl.constexpr):
    """The stage's even input columns of the rows at xa [block_K/2, block_M], and the odd ones KP further on: bf16
    (fp32 with DOT_FP32), zeros where mask_x is off."""
    x_even = tl.load(xa, mask=mask_x, other=0.0).to(tl.float32)
    x_odd = tl.load(xa + KP, mask=mask_x, other=0.0).to(tl.float32)
    if not DOT_FP32:
        x_even = x_even.to(tl.bfloat16)
        x_odd = x_odd.to(tl.bfloat16)
    return x_even, x_odd


@triton.jit
def accumulate(acc1, acc3, which: tl.constexpr, lo, hi, x_even, x_odd, DOT_FP32: tl.constexpr):
    """(acc1, acc3) with weight `which` (0: w1 into acc1, 1: w3 into acc3) applied: acc + lo x_even + hi x_odd, in
    that order, a weight's even and odd input columns against the activations'."""
    precision: tl.constexpr = "ieee" if DOT_FP32 else None
    if which == 0:
        acc1 = tl.dot(hi, x_odd, tl.dot(lo, x_even, acc1, input_precision=precision), input_precision=precision)
    else:
        acc3 = tl.dot(hi, x_odd, tl.dot(lo, x_even, acc3, input_precision=precision), input_precision=precision)
    return acc1, acc3


@triton.jit
def end_stage(acc1, acc3, ASM: tl.constexpr, GATED: tl.constexpr):
    """The accumulators once the stage's products have finished (`settled`), before the next stage decodes; the
    interpreter (no ASM) has nothing in flight."""
    if ASM:
        acc1 = settled(acc1)
        if GATED:
            acc3 = settled(acc3)
    return acc1, acc3


@triton.jit
def settled(acc):
    """acc itself, through an instruction that is not a dot, so that Triton waits for the wgmma instructions that
    accumulate it where it is used: both fp4 loops end each stage with it. A wgmma reads its register operand (the
    decoded weights) after it is issued; Triton 3.6 leaves a stage's last products in flight across the loop's back
    edge without keeping their registers live, and ptxas gives those registers to the next stage's loads and
    decoding. On an H100 GEMM 2 then gave other outputs from run to run, on raw codes and on fragments alike
    (bench/RESULTS.md); bench/moe_sass.py's `operand_hazards` finds such writes in the cubins."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True, pack=1)


__all__ = ["accumulate", "activations", "end_stage", "settled"]
