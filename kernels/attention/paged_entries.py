"""Tiles of cache entries for the in-place kernels (kernels/attention/paged_attention.py, the indexer's in-place scores
in kernels/indexer/index_scores.py): where a block of a token's entries lies in the caches, its raw codes and scales,
and its values as the two halves the kernels multiply; and the pools and index tensors as the kernels take them.

An entry of D values comes out as two [block_S, D / 2] tiles: its even columns and its odd ones. Its codes load as
whole rows of 32-bit words (16-byte loads: four e4m3 codes a word, or eight e2m1 codes, the even column's in each
byte's low nibble, as dsl/cache_format.py packs them), its scales as one small [block_S, D / BLOCK] tile, and a word
decodes with a few shifts and masks into bf16 pairs of even and of odd columns, so nothing is interleaved. The
values are exact: an e4m3 or e2m1 code times its scale has at most 8 significant bits, which bf16 holds.
"""

from __future__ import annotations

import torch

from dsl.cache_format import EntryFormat
from kernels.lang import tl, triton

KINDS = {"fp32": 0, "fp8": 1, "fp4": 2}


@triton.jit
def window_rows(b, oldest, pos, slot, RING, WINDOW: tl.constexpr, block_S: tl.constexpr):
    """Block b of a token's window entries, positions oldest + b * block_S + i: their ring rows [block_S] in the
    slot's ring (position p at row p % RING) and which are visible (at most WINDOW entries, none past pos)."""
    li = b * block_S + tl.arange(0, block_S)
    p = oldest + li
    return slot * RING + p % RING, (li < WINDOW) & (p <= pos)


@triton.jit
def pick_ids(topk_ptr, t, b, TOPK: tl.constexpr, block_S: tl.constexpr):
    """Block b of token t's picks [block_S] (-1 past the last)."""
    li = b * block_S + tl.arange(0, block_S)
    return tl.load(topk_ptr + t * TOPK + li, mask=li < TOPK, other=-1)


@triton.jit
def pick_rows(pick, chunk, length, table_ptr, TABLE_W, PER):
    """Pool rows [block_S] of picks `pick` of chunk `chunk` (entry e at row e % PER of block tables[chunk, e // PER])
    and which exist (named, and below the chunk's compressed length)."""
    picked = (pick >= 0) & (pick < length)
    block = tl.load(table_ptr + chunk * TABLE_W + pick // PER, mask=picked, other=0)
    return block * PER + pick % PER, picked


@triton.jit
def load_tile(codes_ptr, scales_ptr, rows, valid, D: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """The raw tile of pool rows `rows` [block_S] where `valid` (0 elsewhere): the codes as 32-bit words
    [block_S, D / 4] (fp8) or [block_S, D / 8] (fp4) and the scale bytes [block_S, D / BLOCK]; of fp32 entries, the
    even and odd values themselves."""
    r = rows.to(tl.int64)[:, None]
    if KIND == 0:
        c = tl.arange(0, D // 2)[None, :]
        even = tl.load(codes_ptr + r * D + 2 * c, mask=valid[:, None], other=0.0)
        odd = tl.load(codes_ptr + r * D + 2 * c + 1, mask=valid[:, None], other=0.0)
        return even, odd
    WORDS: tl.constexpr = D // 4 if KIND == 1 else D // 8
    words = tl.load(codes_ptr + r * WORDS + tl.arange(0, WORDS)[None, :], mask=valid[:, None], other=0)
    scales = tl.load(scales_ptr + r * (D // BLOCK) + tl.arange(0, D // BLOCK)[None, :], mask=valid[:, None],
                     other=0)
    return words, scales


@triton.jit
def bf16_halves(bits):
    """The low and high 16 bits of uint32 `bits` as bf16 (in registers: the two halves of each word)."""
    return (bits & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True), \
        (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def decode_tile(codes, scales, KIND: tl.constexpr, BLOCK: tl.constexpr, E4M3: tl.constexpr, block_S: tl.constexpr,
                D: tl.constexpr, DTYPE: tl.constexpr):
    """The even and odd values [block_S, D / 2] in DTYPE of a tile `load_tile` read: code value times block scale
    (ue8m0 scale bytes: 2^(byte - 127), 1 <= byte <= 254 as rounding makes them; e4m3 scales: their value).

    Each code is moved, two to a word, to the bf16 bits of its value times 2^-120 (e4m3: exponent and mantissa
    shifted into place, zero exponents making bf16 subnormals) or 2^-126 (e2m1 likewise); two packed bf16 products,
    by 2^120 or 2^126 and by the scale, give the value, exactly: no rounding, no range crossed."""
    if KIND == 0:
        return codes.to(DTYPE), scales.to(DTYPE)
    NB: tl.constexpr = D // BLOCK
    if E4M3:
        scale = scales.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(tl.bfloat16)
    else:
        scale = (scales.to(tl.uint16) << 7).to(tl.bfloat16, bitcast=True)
    s = scale[:, :, None]  # [block_S, NB, 1]
    if KIND == 1:  # a word: the e4m3 codes of columns 4w .. 4w + 3, a byte each
        w = tl.reshape(codes, [block_S, NB, BLOCK // 4]).to(tl.uint32, bitcast=True)
        up = tl.full(s.shape, 247 << 7, tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^120
        e0, e1 = bf16_halves(((w & 0x007F007F) << 4) | ((w & 0x00800080) << 8))  # columns 4w, 4w + 2
        o0, o1 = bf16_halves(((w >> 4) & 0x07F007F0) | (w & 0x80008000))  # columns 4w + 1, 4w + 3
        even = tl.join(e0 * up * s, e1 * up * s)  # [block_S, NB, BLOCK / 4, 2]
        odd = tl.join(o0 * up * s, o1 * up * s)
    else:  # a word: four bytes of two e2m1 codes s|e1 e0 m, the even column's in the low nibble
        w = tl.reshape(codes, [block_S, NB, BLOCK // 8]).to(tl.uint32, bitcast=True)
        up = tl.full(s.shape, 253 << 7, tl.uint16).to(tl.bfloat16, bitcast=True)  # 2^126
        x01 = (w & 0xFF) | ((w & 0xFF00) << 8)  # bytes 0 and 1 in the low bytes of the halves
        x23 = ((w >> 16) & 0xFF) | ((w >> 8) & 0xFF0000)
        e0, e1 = bf16_halves(((x01 << 6) & 0x01C001C0) | ((x01 << 12) & 0x80008000))  # low nibbles: even columns
        e2, e3 = bf16_halves(((x23 << 6) & 0x01C001C0) | ((x23 << 12) & 0x80008000))
        o0, o1 = bf16_halves(((x01 << 2) & 0x01C001C0) | ((x01 << 8) & 0x80008000))  # high nibbles: odd columns
        o2, o3 = bf16_halves(((x23 << 2) & 0x01C001C0) | ((x23 << 8) & 0x80008000))
        even = tl.join(tl.join(e0 * up * s, e2 * up * s), tl.join(e1 * up * s, e3 * up * s))
        odd = tl.join(tl.join(o0 * up * s, o2 * up * s), tl.join(o1 * up * s, o3 * up * s))
    return tl.reshape(even, [block_S, D // 2]).to(DTYPE), tl.reshape(odd, [block_S, D // 2]).to(DTYPE)


def index_operand(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An index tensor as the in-place kernels take it: int32, contiguous, 16-byte aligned (the cubin launcher checks
    it)."""
    if t.is_floating_point() or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be integer {list(shape)}, got {t.dtype} {list(t.shape)}")
    t = t.to(torch.int32).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def pool_operands(fmt: EntryFormat, parts: list[torch.Tensor], d: int,
                  name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(codes, scales, constexprs) of a pool [blocks or slots, rows, ...] in `fmt` holding entries of d values: codes
    as the in-place kernels read them (fp8 and fp4: 32-bit words, fp32: values), scales as bytes."""
    if fmt.kind not in KINDS or (fmt.kind == "fp8" and fmt.e4m3_scale):
        raise ValueError(f"{name}: no in-place kernel reads {fmt}")
    width = d // 2 if fmt.kind == "fp4" else d
    if parts[0].dim() != 3 or parts[0].shape[2] != width or not all(p.is_contiguous() for p in parts):
        raise ValueError(f"{name}: {fmt} entries of {d} values need contiguous parts [*, rows, {width}], got "
                         f"{[list(p.shape) for p in parts]}")
    block = fmt.block if fmt.kind != "fp32" else d
    if fmt.kind != "fp32" and (d % block or block % 2 or parts[1].shape != (*parts[0].shape[:2], d // block)):
        raise ValueError(f"{name}: {fmt} scales must be [*, rows, {d // block}], got {list(parts[1].shape)}")
    if fmt.kind != "fp32" and (block & (block - 1) or block < (4 if fmt.kind == "fp8" else 8)):
        raise ValueError(f"{name}: {fmt} needs blocks of a power of two of whole 32-bit words of codes")
    as_bytes = [p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in parts]
    codes = as_bytes[0] if fmt.kind == "fp32" else as_bytes[0].view(torch.int32)
    return codes, as_bytes[-1], {"KIND": KINDS[fmt.kind], "BLOCK": block, "E4M3": fmt.e4m3_scale}


__all__ = ["KINDS", "bf16_halves", "decode_tile", "index_operand", "load_tile", "pick_ids", "pick_rows",
           "pool_operands", "window_rows"]
