"""fp4 expert codes stored in the order of the tensor cores' register fragments (executor format "fragments"): the
grouped GEMMs of experts.py load them as 32-bit words, 8 bytes a thread, and turn 8 codes into 4 bf16 pairs in 8
integer instructions, where the raw [E, N, K/2] codes cost 2-byte loads and 14 instructions (bench/RESULTS.md).

The weights are wgmma's A operand, read from registers: for each 16 columns, lane 4g + c of the warp holding rows
[16w, 16w + 16) holds columns 2c, 2c + 1 (one register) and 2c + 8, 2c + 9 of rows g and g + 8. A packed byte holds
an even and an odd input, which meet the even and the odd activations in two products (experts.py), so each lane
needs 4 bytes of each of its two rows per 32 inputs. `fragment_codes` stores an expert's [N, K/2] codes as
[N/16, K/32, 32 lanes, 8 bytes]; a lane's 8 bytes are [q, h, p]: columns 8q + 2c + p of row g + 8h.

The kernels load int32 words and decode each one alone (`_decode_asm`: one word in, its 8 codes out), then put the
codes in row and column order by reshapes and a permutation (`_bytes`, `_unfragment`). The values therefore never
depend on the layouts Triton picks: under wgmma tiles (64-row warpgroups) the relabelling moves no data and the loop
has no byte shuffles (bench/moe_sass.py); under narrower tiles Triton lowers the dot to mma.sync, whose operand takes
4 consecutive inputs a lane, and moves the codes between registers: the same values, more instructions.

Each word's 32 bits are permuted so that its 8 codes become the bf16 bit patterns sign << 15 | e2m1 magnitude << 6,
i.e. e2m1 * 2^-126 (e = 0 on bf16 subnormals, exact), the values raw_codes.py's `_e2m1_asm` makes, with
M = 0x81C081C0 the two patterns' bits:

    pair 0 (low nibbles of bytes 0, 1)    w & M
    pair 1 (low nibbles of bytes 2, 3)    rotl(w, 10) & M
    pair 2 (high nibbles of bytes 0, 1)   rotl(w, 13) & M
    pair 3 (high nibbles of bytes 2, 3)   ((w & 0x001B001B) * 0x1084) & M: three copies of 8 bits, no carries

`_fields` reads off which bit of a word lands where; the formats build and undo words with it.
"""

from __future__ import annotations

import functools

import torch

from kernels.lang import tl, triton
from kernels.moe.stages import accumulate, activations, end_stage, scale_factor

MASK = 0x81C081C0  # per bf16 half: the sign (bit 15) and the magnitude (bits 8..6)
ROTATIONS = (10, 13)  # pairs 1 and 2
LEFT, SPREAD = 0x001B001B, (1 << 2) | (1 << 7) | (1 << 12)  # pair 3: the bits the other pairs leave, and their copies
_NIBBLE_BIT = {15: 3, 8: 2, 7: 1, 6: 0}  # a pattern bit (within its half) -> the e2m1 code bit: sign, e1, e0, m
UNIT = 256  # bytes of one 16-row group over 32 inputs


def decode_word(w: int) -> tuple[int, int, int, int]:
    """A word (uint32) -> its four bf16 pairs as the kernels compute them (the low half holds the first byte's code)."""
    rot = [((w << s) | (w >> (32 - s))) & 0xFFFFFFFF for s in ROTATIONS]
    return w & MASK, rot[0] & MASK, rot[1] & MASK, ((w & LEFT) * SPREAD) & MASK


@functools.cache
def _fields() -> tuple[tuple[int, int, int], ...]:
    """For each bit j of a word, (byte, nibble shift, code bit) of the code bit it carries: read off by decoding the
    word with bit j alone set."""
    out = []
    for j in range(32):
        hits = [(k, p) for k, pair in enumerate(decode_word(1 << j)) for p in range(32) if pair >> p & 1]
        if len(hits) != 1 or hits[0][1] % 16 not in _NIBBLE_BIT:
            raise AssertionError(f"word bit {j} decodes to {hits}: the fp4 fragment encoding is not a permutation")
        k, p = hits[0]
        out.append((2 * (k % 2) + p // 16, 4 * (k // 2), _NIBBLE_BIT[p % 16]))
    return tuple(out)


@functools.cache
def _tables() -> torch.Tensor:
    """int32 [4, 256]: the bits of a word that byte i (0..3) of it sets, for each value of that byte."""
    table = torch.zeros(4, 256, dtype=torch.int64)
    values = torch.arange(256)
    for j, (byte, shift, bit) in enumerate(_fields()):
        table[byte] |= ((values >> (shift + bit)) & 1) << j
    return torch.where(table >= 2**31, table - 2**32, table).to(torch.int32)


def _check_codes(codes: torch.Tensor) -> None:
    if codes.dtype != torch.uint8 or codes.dim() != 3 or codes.shape[1] % 16 or codes.shape[2] % 16:
        raise ValueError(f"fp4 codes must be uint8 [E, N, K/2] with N a multiple of 16 and K of 32, got "
                         f"{codes.dtype} {list(codes.shape)}")


def fragment_codes(codes: torch.Tensor, chunk_bytes: int = 1 << 24) -> torch.Tensor:
    """Packed fp4 expert codes uint8 [E, N, K/2] (byte i of a row: input 2i in the low nibble, 2i + 1 in the high
    one) -> the same codes uint8 [E, N/16, K/32, 256] in fragment order, on the same device; a few experts at a
    time (`chunk_bytes` of codes), so the temporaries stay small beside a layer's experts."""
    _check_codes(codes)
    e, n, kp = codes.shape
    out = torch.empty(e, n // 16, kp // 16, UNIT, dtype=torch.uint8, device=codes.device)
    table = _tables().to(codes.device)
    step = max(1, chunk_bytes // max(1, n * kp))
    for first in range(0, e, step):
        part = codes[first:first + step]
        # row 16r + 8h + g, packed column 16u + 8q + 2c + p -> [r, u, g, c, q, h, p]
        b = part.reshape(-1, n // 16, 2, 8, kp // 16, 2, 4, 2).permute(0, 1, 4, 3, 6, 5, 2, 7).reshape(-1, 4).int()
        word = table[0, b[:, 0]] | table[1, b[:, 1]] | table[2, b[:, 2]] | table[3, b[:, 3]]
        out[first:first + step] = word.view(torch.uint8).view(out[first:first + step].shape)
    return out


def raw_codes(fragments: torch.Tensor) -> torch.Tensor:
    """`fragment_codes` undone: uint8 [E, N/16, K/32, 256] -> [E, N, K/2]."""
    if fragments.dtype != torch.uint8 or fragments.dim() != 4 or fragments.shape[3] != UNIT:
        raise ValueError(f"fp4 fragments must be uint8 [E, N/16, K/32, {UNIT}], got {fragments.dtype} "
                         f"{list(fragments.shape)}")
    e, groups, units, _ = fragments.shape
    word = fragments.reshape(-1, 4).view(torch.int32).reshape(-1).long()
    b = torch.zeros(word.shape[0], 4, dtype=torch.long, device=fragments.device)
    for j, (byte, shift, bit) in enumerate(_fields()):
        b[:, byte] |= ((word >> j) & 1) << (shift + bit)
    v = b.to(torch.uint8).reshape(e, groups, units, 8, 4, 2, 2, 2)  # [r, u, g, c, q, h, p]
    return v.permute(0, 1, 6, 3, 2, 5, 4, 7).reshape(e, groups * 16, units * 16)


@triton.jit
def _decode_asm(w):
    """int32 words in fragment order -> their 8 codes as bf16 e2m1 * 2^-126, 8 tensors of w's shape: the low nibbles
    of bytes 0..3, then the high nibbles of bytes 0..3. One word per instance, so a word is whole whatever layout
    Triton gives w."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t, p;
        and.b32 p, $8, 0x81C081C0;
        mov.b32 {$0, $1}, p;
        shf.l.wrap.b32 t, $8, $8, 10;
        and.b32 p, t, 0x81C081C0;
        mov.b32 {$2, $3}, p;
        shf.l.wrap.b32 t, $8, $8, 13;
        and.b32 p, t, 0x81C081C0;
        mov.b32 {$4, $5}, p;
        and.b32 t, $8, 0x001B001B;
        mul.lo.u32 t, t, 0x1084;
        and.b32 p, t, 0x81C081C0;
        mov.b32 {$6, $7}, p;
        }""", "=h,=h,=h,=h,=h,=h,=h,=h,r", [w],
        dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16),
        is_pure=True, pack=1)


@triton.jit
def _rotl(w, s: tl.constexpr):
    return (w << s) | (w >> (32 - s))


@triton.jit
def _halves(pair):
    """uint32 bf16 pairs -> their low and high halves, as fp32 of the same values."""
    return (pair << 16).to(tl.float32, bitcast=True), (pair & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _decode_plain(w):
    """`_decode_asm` in plain operations (Triton's interpreter runs no PTX), to fp32."""
    word = w.to(tl.uint32, bitcast=True)
    l0, l1 = _halves(word & 0x81C081C0)
    l2, l3 = _halves(_rotl(word, 10) & 0x81C081C0)
    h0, h1 = _halves(_rotl(word, 13) & 0x81C081C0)
    h2, h3 = _halves(((word & 0x001B001B) * 0x1084) & 0x81C081C0)
    return l0, l1, l2, l3, h0, h1, h2, h3


@triton.jit
def _bytes(b0, b1, b2, b3, R: tl.constexpr, C: tl.constexpr):
    """Four [R, C/4] tensors, one value per byte i of each word -> [R, C] in byte order (byte 4j + i)."""
    # join stacks on a new last axis: join(join(b0, b2), join(b1, b3)) is [.., q, p], byte 2q + p
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), [R, C])


@triton.jit
def _unfragment(x, block_N: tl.constexpr, block_K: tl.constexpr):
    """[block_N/16, block_K/32 * 256] in fragment order -> [block_N, block_K/2] (rows, packed columns), a relabelling
    that moves no data when x holds wgmma's A layout."""
    x = tl.reshape(x, [block_N // 16, block_K // 32, 8, 4, 2, 2, 2])  # [r, u, g, c, q, h, p]
    x = tl.permute(x, [0, 5, 2, 1, 4, 3, 6])  # [r, h, g, u, q, c, p]
    return tl.reshape(x, [block_N, block_K // 2])


@triton.jit
def _weights(wp, sp, wo, so, mask_w, mask_s, EVEN: tl.constexpr, ASM: tl.constexpr, DOT_FP32: tl.constexpr,
             block_N: tl.constexpr, block_K: tl.constexpr):
    """One stage of a weight, int32 words at wo [block_N/16, block_K/32 * 64] and scales at so [block_N, block_K/32]
    -> its even and odd input columns * 2^-63, [block_N, block_K/2], bf16 (fp32 with DOT_FP32): raw_codes.py's
    `_dequant`, value for value."""
    if EVEN:
        w = tl.load(wp + wo)
        s = tl.load(sp + so)
    else:
        w = tl.load(wp + wo, mask=mask_w, other=0)
        s = tl.load(sp + so, mask=mask_s, other=0)
    R: tl.constexpr = block_N // 16
    C: tl.constexpr = block_K // 32 * 256
    if ASM:
        l0, l1, l2, l3, h0, h1, h2, h3 = _decode_asm(w)  # e2m1 * 2^-126
        lo = _bytes(l0, l1, l2, l3, R, C)
        hi = _bytes(h0, h1, h2, h3, R, C)
    else:  # e2m1 * 2^-14, as raw_codes.py's plain decoding
        l0, l1, l2, l3, h0, h1, h2, h3 = _decode_plain(w)
        lo = _bytes(l0, l1, l2, l3, R, C) * 5.192296858534828e33  # * 2^112, exact
        hi = _bytes(h0, h1, h2, h3, R, C) * 5.192296858534828e33
    f = scale_factor(s, ASM, block_N, block_K)
    lo = _unfragment(lo, block_N, block_K) * f
    hi = _unfragment(hi, block_N, block_K) * f
    if not ASM and not DOT_FP32:  # one return (see raw_codes.py's `_dequant`)
        lo, hi = lo.to(tl.bfloat16), hi.to(tl.bfloat16)
    return lo, hi


@triton.jit
def fragment_products(a_ptr, a_rows, valid, w_ptr, s_ptr, w3_ptr, s3_ptr, e, n_begin, w_rows, mask_n, k_begin,
                      N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr, GATED: tl.constexpr,
                      DOT_FP32: tl.constexpr, ASM: tl.constexpr, EVEN: tl.constexpr, block_M: tl.constexpr,
                      block_N: tl.constexpr, block_K: tl.constexpr):
    """raw_codes.py's `raw_products` (the same products, in the same order) over codes in fragment order
    [E, N/16, K/32, 256]: (x w1^T, x w3^T) of output rows [n_begin, n_begin + block_N) over inputs
    [k_begin, k_begin + K_PER_SPLIT) ∩ [0, K)."""
    KP: tl.constexpr = K // 2
    SC: tl.constexpr = K // 32
    kh = k_begin // 2 + tl.arange(0, block_K // 2)
    sg = k_begin // 32 + tl.arange(0, block_K // 32)
    xa = a_ptr + a_rows[None, :] * K + kh[:, None]  # [block_K/2, block_M]; the odd columns at + K/2
    groups = (e * N + n_begin) // 16 + tl.arange(0, block_N // 16)  # the tile's 16-row groups
    cols = tl.arange(0, block_K // 32 * 64)  # int32 words: 64 a 16-row group over 32 inputs
    wo = (groups.to(tl.int64)[:, None] * SC + k_begin // 32) * 64 + cols[None, :]
    so = w_rows[:, None] * SC + sg[None, :]  # [block_N, block_K/32]
    mask_g = (n_begin + tl.arange(0, block_N // 16) * 16) < N
    unit = k_begin // 32 + cols // 64
    acc1 = tl.zeros([block_N, block_M], dtype=tl.float32)
    acc3 = tl.zeros([block_N, block_M], dtype=tl.float32)
    for _ in range(0, K_PER_SPLIT, block_K):
        _, x_even, x_odd = activations(xa, kh, KP, valid, EVEN, DOT_FP32)
        mask_w = mask_g[:, None] & (unit < SC)[None, :]
        mask_s = mask_n[:, None] & (sg < SC)[None, :]
        for which in tl.static_range(2 if GATED else 1):
            wp = w_ptr if which == 0 else w3_ptr
            sp = s_ptr if which == 0 else s3_ptr
            lo, hi = _weights(wp, sp, wo, so, mask_w, mask_s, EVEN, ASM, DOT_FP32, block_N, block_K)
            acc1, acc3 = accumulate(acc1, acc3, which, lo, hi, x_even, x_odd, DOT_FP32)
        acc1, acc3 = end_stage(acc1, acc3, ASM, GATED)
        xa += block_K // 2
        wo += block_K // 32 * 64
        so += block_K // 32
        kh += block_K // 2
        sg += block_K // 32
        unit += block_K // 32
    return acc1 * 9.223372036854775808e18, acc3 * 9.223372036854775808e18  # 2^63: the weights' 2^-63 undone


__all__ = ["UNIT", "decode_word", "fragment_codes", "fragment_products", "raw_codes"]
