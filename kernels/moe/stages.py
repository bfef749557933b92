"""One K stage of the fp4 grouped GEMMs, the pieces both product loops share (raw_codes.py's `raw_products`,
fragments.py's `fragment_products` on codes in fragment order): the activations' even and odd input columns, the
scales' factor, the two products a weight makes with them, and the wait that ends a stage.
"""

from __future__ import annotations

from kernels.lang import tl, triton


@triton.jit
def activations(xa, kh, KP: tl.constexpr, valid, EVEN: tl.constexpr, DOT_FP32: tl.constexpr):
    """The stage's packed columns kh in range (mask_k, unused when EVEN), and the even input columns of the valid
    slots' rows at xa [block_K/2, block_M] with the odd ones KP further on: bf16 (fp32 with DOT_FP32), zeros
    elsewhere."""
    mask_k = kh < KP
    mask_x = valid[None, :] & (mask_k | EVEN)[:, None]
    x_even = tl.load(xa, mask=mask_x, other=0.0).to(tl.float32)
    x_odd = tl.load(xa + KP, mask=mask_x, other=0.0).to(tl.float32)
    if not DOT_FP32:
        x_even = x_even.to(tl.bfloat16)
        x_odd = x_odd.to(tl.bfloat16)
    return mask_k, x_even, x_odd


@triton.jit
def scale_factor(s, ASM: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    """Scales s [block_N, block_K/32] (fp32 powers of two, or bf16 scale * 2^63: experts.py's `prescaled`) -> the
    factor each decoded code is multiplied by, [block_N, block_K/2]: scale * 2^63 in bf16 against the asm's
    e2m1 * 2^-126, or scale * 2^-49 in fp32 against the plain decoding's e2m1 * 2^-14; both give e2m1 * scale *
    2^-63, exact."""
    if ASM:
        f = s if s.dtype == tl.bfloat16 else (s * 9.223372036854775808e18).to(tl.bfloat16)
    else:
        if s.dtype == tl.bfloat16:
            s = s.to(tl.float32) * 1.0842021724855044e-19  # * 2^-63
        f = s * 1.7763568394002505e-15
    return tl.reshape(tl.broadcast_to(f[:, :, None], [block_N, block_K // 32, 16]), [block_N, block_K // 2])


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


__all__ = ["accumulate", "activations", "end_stage", "scale_factor", "settled"]
