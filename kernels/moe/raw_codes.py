"""fp4 expert codes as stored, [E, out, in/2] (byte i of a row: input 2i in the low nibble, 2i + 1 in the high one):
their decoding and products in the grouped GEMMs of experts.py (fragments.py holds the same for codes in fragment
order).

Two packed codes become a bf16 pair in one integer multiply and three bit operations (`_e2m1_asm`, PTX): the
magnitude bits go under the bf16 exponent, `(code & 7) << 6`, which reads as e2m1 * 2^-126 (e = 0 lands on bf16
subnormals, exact), and one bf16x2 multiply by the block scale * 2^63 leaves e2m1 * scale * 2^-63, exact; the
accumulator is multiplied back by 2^63 at the end (a power of two: the same sums). That halves GEMM 1's instructions
per stage against converting through fp16 and fp32. The even and odd input columns of a packed byte meet the even
and odd activations in two products, so nothing is interleaved. Triton's interpreter runs no PTX: there (and for
fp32 products) the same values come from plain integer and float operations.
"""

from __future__ import annotations

from kernels.lang import tl, triton
from kernels.moe.stages import accumulate, activations, end_stage, scale_factor


@triton.jit
def _e2m1_asm(b):
    # two bytes per instance -> their low and high nibbles as bf16 bits; per half: magnitude (3 bits) to bits 6..8,
    # sign to bit 15, via one multiply by 2^6 + 2^12 of the isolated nibble (the two copies do not overlap)
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, u;
        prmt.b32 t, $2, 0, 0x5140;
        and.b32 u, t, 0x000F000F;
        mul.lo.u32 u, u, 0x1040;
        and.b32 $0, u, 0x81C081C0;
        and.b32 u, t, 0x00F000F0;
        mul.lo.u32 u, u, 0x104;
        and.b32 $1, u, 0x81C081C0;
        }""", "=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=2)


@triton.jit
def _dequant(b, s, ASM: tl.constexpr, DOT_FP32: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    """Packed codes b uint8 [block_N, block_K/2] and scales s [block_N, block_K/32] (fp32 powers of two, or bf16
    scale * 2^63: `prescaled`) -> the even and odd columns' weights * 2^-63, bf16 (fp32 with DOT_FP32)."""
    f = scale_factor(s, ASM, block_N, block_K)
    if ASM:
        lo, hi = _e2m1_asm(b)
        return lo * f, hi * f
    else:
        # the code as an fp16 exponent/mantissa: e2m1 * 2^-14 (e = 0 on fp16 subnormals, exact)
        b = b.to(tl.int32)
        lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * f
        hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * f
        if not DOT_FP32:  # one return: Triton 3.6 compiles both returns of a static branch and refuses their dtypes
            lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
        return lo, hi


@triton.jit
def raw_products(a_ptr, a_rows, valid, w_ptr, s_ptr, w3_ptr, s3_ptr, w_rows, mask_n, k_begin, K: tl.constexpr,
                 K_PER_SPLIT: tl.constexpr, GATED: tl.constexpr, DOT_FP32: tl.constexpr, ASM: tl.constexpr,
                 EVEN: tl.constexpr, block_M: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    """(x w1^T, x w3^T) over inputs [k_begin, k_begin + K_PER_SPLIT) ∩ [0, K) for fp4 weights: two products per
    weight and stage, the even and the odd input columns. The rows of x (GEMM 1) and of h (GEMM 2) hold the even
    columns, then the odd ones (contiguous loads). Only the valid slots' rows are read: a decode block has a few.
    EVEN: no K or N masks (block_N divides N, the splits tile K)."""
    KP: tl.constexpr = K // 2
    SC: tl.constexpr = K // 32
    kh = k_begin // 2 + tl.arange(0, block_K // 2)  # packed column: inputs 2*kh (low nibble), 2*kh + 1 (high)
    sg = k_begin // 32 + tl.arange(0, block_K // 32)
    xa = a_ptr + a_rows[None, :] * K + kh[:, None]  # [block_K/2, block_M]; the odd columns at + K/2
    wo = w_rows[:, None] * KP + kh[None, :]  # [block_N, block_K/2], for w1 and w3 alike
    so = w_rows[:, None] * SC + sg[None, :]  # [block_N, block_K/32]
    acc1 = tl.zeros([block_N, block_M], dtype=tl.float32)
    acc3 = tl.zeros([block_N, block_M], dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, block_K):
        mask_k, x_even, x_odd = activations(xa, kh, KP, valid, EVEN, DOT_FP32)
        for which in tl.static_range(2 if GATED else 1):
            wp = w_ptr if which == 0 else w3_ptr
            sp = s_ptr if which == 0 else s3_ptr
            if EVEN:
                b = tl.load(wp + wo)
                s = tl.load(sp + so)
            else:
                b = tl.load(wp + wo, mask=mask_n[:, None] & mask_k[None, :], other=0)
                s = tl.load(sp + so, mask=mask_n[:, None] & (sg < SC)[None, :], other=0)
            lo, hi = _dequant(b, s, ASM, DOT_FP32, block_N, block_K)
            acc1, acc3 = accumulate(acc1, acc3, which, lo, hi, x_even, x_odd, DOT_FP32)
        acc1, acc3 = end_stage(acc1, acc3, ASM, GATED)
        xa += block_K // 2
        wo += block_K // 2
        so += block_K // 32
        kh += block_K // 2
        sg += block_K // 32
    return acc1 * 9.223372036854775808e18, acc3 * 9.223372036854775808e18  # 2^63: the weights' 2^-63 undone


__all__ = ["raw_products"]
