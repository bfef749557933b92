"""Cache entries into and out of their storage formats (dsl/cache_format.py), one launch per call.

`store_rows` encodes rows of fp32 values as their format's codes and block scales and scatters them into a pool's
parts; `load_rows` gathers rows and decodes them. Same arguments as `dsl.cache.store_rows` / `load_rows`, whose
torch code (`EntryFormat.encode` / `decode`) they match bit for bit, working from the fp32 bits:
- a ue8m0 scale pow2_ceil(amax / qmax) is the byte "exponent field of amax / qmax (divided exactly, `div_rn`),
  plus one when its mantissa is not zero"; dividing by it is multiplying by 2^(127 - byte), exact;
- e4m3 codes round to nearest even (as torch's cast); an e2m1 code counts the midpoints its value
  reaches (ties to the even code), the sign kept as bit 3 (-0.0 included);
- an e4m3-scaled fp4 block tries the reference's candidate maxima in its order and keeps the first scale that is an
  e4m3 value and reproduces the block. Where none does (values off the grid) the reference raises; here the block
  keeps scale 1, as the reference's default, unchecked: checking would wait for the device.
One program per row: the row's blocks as a [blocks, block] tile (fp4: its even and odd columns apart, the low and
high nibbles of the packed bytes).
"""

from __future__ import annotations

import torch

from dsl.cache import CacheSpec
from dsl.cache_format import EntryFormat
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch

KINDS = {"fp32": 0, "fp8": 1, "fp4": 2}
KERNEL_NAMES = ("store_rows_kernel", "load_rows_kernel")


@triton.jit
def _pool_row(major_ptr, minor_ptr, table_ptr, m, PER, TABLE_W, HAS_TABLE: tl.constexpr):
    """Row block * PER + minor % PER of the pool (parts flat over [blocks * PER]): block tables[major, minor // PER],
    or major without a table; and whether the row is there at all (major >= 0)."""
    major = tl.load(major_ptr + m)
    minor = tl.load(minor_ptr + m)
    present = major >= 0
    if HAS_TABLE:
        block = tl.load(table_ptr + major * TABLE_W + minor // PER, mask=present, other=0)
    else:
        block = major
    return block * PER + minor % PER, present


@triton.jit
def _pow2_byte(a):
    """The ue8m0 byte of pow2_ceil(a), a >= 0 finite: exponent field, plus one for a non-zero mantissa."""
    bits = a.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2_value(byte):
    """2^(byte - 127) as fp32 (byte 0: 2^-127, a subnormal; 255: NaN), as `dsl.quant.scale_to_float`."""
    normal = (byte << 23).to(tl.float32, bitcast=True)
    tiny = tl.full(byte.shape, 0x400000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(byte == 255, float("nan"), tl.where(byte == 0, tiny, normal))


@triton.jit
def _e4m3_bits(x):
    """e4m3fn codes (int32, sign in bit 7) of fp32 x: nearest, ties to even; saturated at 448, which encoding never
    passes (|x / scale| <= 448)."""
    bits = x.to(tl.int32, bitcast=True)
    abits = bits & 0x7FFFFFFF
    normal = ((abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20) - (120 << 3)  # exponent rebiased 127 -> 7
    t = tl.minimum(tl.abs(x), 1.0) * 512.0  # subnormal codes count 2^-9
    whole = t.to(tl.int32)
    rest = t - whole.to(tl.float32)
    sub = whole + ((rest > 0.5) | ((rest == 0.5) & ((whole & 1) == 1))).to(tl.int32)
    mag = tl.minimum(tl.where(abits >= (121 << 23), normal, sub), 0x7E)
    return mag | ((bits >> 24) & 0x80)


@triton.jit
def _e4m3_value(code):
    """fp32 value of e4m3fn codes (int32, sign in bit 7; 0x7F and 0xFF are NaN)."""
    mag = code & 0x7F
    exponent = mag >> 3
    mantissa = mag & 7
    normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
    v = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal)
    v = tl.where(mag == 0x7F, float("nan"), v)
    return _with_sign(v, (code & 0x80) != 0)


@triton.jit
def _e2m1_codes(q):
    """e2m1 codes (int32, sign in bit 3) of fp32 q: the midpoints of the grid |q| reaches, ties to the even code."""
    a = tl.abs(q)
    mag = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
           + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    return mag | ((q.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _e2m1_value(code):
    """fp32 value of e2m1 codes (int32, sign in bit 3): {0, .5, 1, 1.5, 2, 3, 4, 6}."""
    mag = code & 7
    half = (mag & 1).to(tl.float32) * 0.5
    exponent = mag >> 1
    v = tl.where(exponent == 0, half, (1.0 + half) * tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0)))
    return _with_sign(v, (code & 8) != 0)


@triton.jit
def _with_sign(v, negative):
    """v >= 0 with its sign bit set where `negative` (-0.0 included: Triton's `-v` is 0 - v)."""
    return (v.to(tl.int32, bitcast=True) | (negative.to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _is_e4m3(s):
    """Whether fp32 s >= 0 is an e4m3 value (`s.to(float8_e4m3fn).float() == s`)."""
    bits = s.to(tl.int32, bitcast=True)
    t = tl.minimum(s, 1.0) * 512.0
    exact = tl.where(bits >= (121 << 23), (bits & 0xFFFFF) == 0, t == t.to(tl.int32).to(tl.float32))
    return (s <= 448.0) & exact


@triton.jit
def _try_fp4_scale(xe, xo, amax, chosen, found, TOP: tl.constexpr):
    """One candidate of `EntryFormat._fp4_scale`: scale amax / TOP where it is an e4m3 value under which the block
    (even columns xe, odd xo [B, C]) is exact and no earlier candidate was."""
    s = tl.math.div_rn(amax, tl.full(amax.shape, TOP, tl.float32))  # [B]
    # s = 0 (amax / TOP underflows) never reproduces a block with amax > 0: divide by 1 instead of making NaNs
    s2 = tl.broadcast_to(tl.where(s > 0.0, s, 1.0)[:, None], xe.shape)
    back = (_e2m1_value(_e2m1_codes(tl.math.div_rn(xe, s2))) * s2 == xe) \
        & (_e2m1_value(_e2m1_codes(tl.math.div_rn(xo, s2))) * s2 == xo)
    ok = (found == 0) & (s > 0.0) & _is_e4m3(s) & (tl.min(back.to(tl.int32), axis=1) == 1)
    return tl.where(ok, s, chosen), found | ok.to(tl.int32)


@triton.jit
def _fp4_e4m3_scale(xe, xo, amax):
    chosen = tl.full(amax.shape, 1.0, tl.float32)
    found = (amax == 0.0).to(tl.int32)
    chosen, found = _try_fp4_scale(xe, xo, amax, chosen, found, 6.0)
    chosen, found = _try_fp4_scale(xe, xo, amax, chosen, found, 4.0)
    chosen, found = _try_fp4_scale(xe, xo, amax, chosen, found, 3.0)
    chosen, found = _try_fp4_scale(xe, xo, amax, chosen, found, 2.0)
    chosen, found = _try_fp4_scale(xe, xo, amax, chosen, found, 1.5)
    chosen, found = _try_fp4_scale(xe, xo, amax, chosen, found, 1.0)
    chosen, found = _try_fp4_scale(xe, xo, amax, chosen, found, 0.5)
    return chosen


@triton.jit
def store_rows_kernel(x_ptr, major_ptr, minor_ptr, table_ptr, codes_ptr, scales_ptr, PER, TABLE_W, D: tl.constexpr,
                      KIND: tl.constexpr, BLOCK: tl.constexpr, E4M3_SCALE: tl.constexpr, HAS_TABLE: tl.constexpr,
                      block_B: tl.constexpr, block_C: tl.constexpr):
    pdl_prologue()
    m = tl.program_id(0).to(tl.int64)
    dst, present = _pool_row(major_ptr, minor_ptr, table_ptr, m, PER, TABLE_W, HAS_TABLE)
    blocks = tl.arange(0, block_B)
    b = blocks[:, None]
    c = tl.arange(0, block_C)[None, :]
    stored_b = (blocks < D // BLOCK) & present  # a row of negative major is not stored
    if KIND == 2:  # fp4: columns 2c and 2c + 1 of each block
        mask = (b < D // BLOCK) & (c < BLOCK // 2)
        xe = tl.load(x_ptr + m * D + b * BLOCK + 2 * c, mask=mask, other=0.0)
        xo = tl.load(x_ptr + m * D + b * BLOCK + 2 * c + 1, mask=mask, other=0.0)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))  # [block_B]
        if E4M3_SCALE:
            scale = _fp4_e4m3_scale(xe, xo, amax)
            s2 = tl.broadcast_to(scale[:, None], xe.shape)
            packed = _e2m1_codes(tl.math.div_rn(xe, s2)) | (_e2m1_codes(tl.math.div_rn(xo, s2)) << 4)
            stored = _e4m3_bits(scale)
        else:
            stored = _pow2_byte(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
            inv = ((254 - stored) << 23).to(tl.float32, bitcast=True)[:, None]  # 1 / 2^(byte - 127)
            packed = _e2m1_codes(xe * inv) | (_e2m1_codes(xo * inv) << 4)
        tl.store(codes_ptr + dst * (D // 2) + b * (BLOCK // 2) + c, packed.to(tl.uint8), mask=mask & present)
        tl.store(scales_ptr + dst * (D // BLOCK) + blocks, stored.to(tl.uint8), mask=stored_b)
    else:
        mask = (b < D // BLOCK) & (c < BLOCK)
        x = tl.load(x_ptr + m * D + b * BLOCK + c, mask=mask, other=0.0)
        if KIND == 0:
            tl.store(codes_ptr + dst * D + b * BLOCK + c, x, mask=mask & present)
        else:  # fp8, power-of-two scales
            byte = _pow2_byte(tl.math.div_rn(tl.max(tl.abs(x), axis=1), tl.full([block_B], 448.0, tl.float32)))
            inv = ((254 - byte) << 23).to(tl.float32, bitcast=True)[:, None]
            tl.store(codes_ptr + dst * D + b * BLOCK + c, _e4m3_bits(x * inv).to(tl.uint8), mask=mask & present)
            tl.store(scales_ptr + dst * (D // BLOCK) + blocks, byte.to(tl.uint8), mask=stored_b)


@triton.jit
def load_rows_kernel(codes_ptr, scales_ptr, major_ptr, minor_ptr, table_ptr, out_ptr, PER, TABLE_W, D: tl.constexpr,
                     KIND: tl.constexpr, BLOCK: tl.constexpr, E4M3_SCALE: tl.constexpr, HAS_TABLE: tl.constexpr,
                     block_B: tl.constexpr, block_C: tl.constexpr):
    pdl_prologue()
    m = tl.program_id(0).to(tl.int64)
    src, _ = _pool_row(major_ptr, minor_ptr, table_ptr, m, PER, TABLE_W, HAS_TABLE)
    blocks = tl.arange(0, block_B)
    b = blocks[:, None]
    c = tl.arange(0, block_C)[None, :]
    if KIND == 0:
        mask = (b < D // BLOCK) & (c < BLOCK)
        tl.store(out_ptr + m * D + b * BLOCK + c, tl.load(codes_ptr + src * D + b * BLOCK + c, mask=mask), mask=mask)
    else:
        byte = tl.load(scales_ptr + src * (D // BLOCK) + blocks, mask=blocks < D // BLOCK, other=0).to(tl.int32)
        scale = (_e4m3_value(byte) if E4M3_SCALE else _pow2_value(byte))[:, None]
        if KIND == 2:
            mask = (b < D // BLOCK) & (c < BLOCK // 2)
            packed = tl.load(codes_ptr + src * (D // 2) + b * (BLOCK // 2) + c, mask=mask, other=0).to(tl.int32)
            out = out_ptr + m * D + b * BLOCK + 2 * c
            tl.store(out, _e2m1_value(packed & 15) * scale, mask=mask)
            tl.store(out + 1, _e2m1_value(packed >> 4) * scale, mask=mask)
        else:
            mask = (b < D // BLOCK) & (c < BLOCK)
            code = tl.load(codes_ptr + src * D + b * BLOCK + c, mask=mask, other=0).to(tl.int32)
            tl.store(out_ptr + m * D + b * BLOCK + c, _e4m3_value(code) * scale, mask=mask)


def _layout(fmt: EntryFormat, parts: list[torch.Tensor], major: torch.Tensor, minor: torch.Tensor,
            tables: torch.Tensor | None) -> tuple[tuple, dict, int]:
    """Checks; (the pool and index arguments, the constexprs, D) of a launch over `parts` at (major, minor); the
    arguments end with the rows per block and the block tables' width (0 without tables)."""
    if fmt.kind not in KINDS or (fmt.kind == "fp8" and fmt.e4m3_scale):
        raise ValueError(f"no cache kernel for {fmt}")
    if any(not p.is_contiguous() or p.dim() != 3 or p.shape[:2] != parts[0].shape[:2] for p in parts):
        raise ValueError("cache parts must be contiguous [blocks, rows, width] of one layout")
    d = parts[0].shape[2] * (2 if fmt.kind == "fp4" else 1)
    block = fmt.block if fmt.kind != "fp32" else d
    if fmt.kind != "fp32" and (d % block or parts[1].shape[2] != d // block or (fmt.kind == "fp4" and block % 2)):
        raise ValueError(f"{fmt} does not lay out entries of {d} values in parts {[list(p.shape) for p in parts]}")
    if major.shape != minor.shape or major.dim() != 1 or (tables is not None and tables.dim() != 2):
        raise ValueError("major and minor must be [M], block tables [B, W]")
    major, minor = _aligned(major.long()), _aligned(minor.long())  # indices of any integer type, as torch takes
    table = _aligned(tables.long()) if tables is not None else minor
    pools = [p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in parts]
    args = (major, minor, table, pools[0], pools[-1], parts[0].shape[1], tables.shape[1] if tables is not None else 0)
    width = block // 2 if fmt.kind == "fp4" else block
    consts = {"D": d, "KIND": KINDS[fmt.kind], "BLOCK": block, "E4M3_SCALE": fmt.e4m3_scale,
              "HAS_TABLE": tables is not None, "block_B": triton.next_power_of_2(d // block),
              "block_C": triton.next_power_of_2(width)}
    return args, consts, d


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous at a 16-byte aligned address, as the cubin launcher needs (a slice may start anywhere)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def store_rows(fmt: EntryFormat, parts: list[torch.Tensor], values: torch.Tensor, major: torch.Tensor,
               minor: torch.Tensor, tables: torch.Tensor | None = None, masked: bool = False) -> None:
    """`dsl.cache.store_rows` in one launch: encode values [M, D] (fp32, or cast to it) in `fmt` and store row m in
    every part [*, R, ...] at [block, minor[m] % R], block tables[major[m], minor[m] // R] ([B, W]) or major[m].
    major, minor: integer [M]. Parts: the codes (fp32 / float8_e4m3fn / uint8 packed fp4) and the scales. A row whose
    major[m] is negative is never stored, `masked` or not: the kernel checks it where it stands, without a wait."""
    (major, minor, table, codes, scales, per, width), consts, d = _layout(fmt, parts, major, minor, tables)
    if values.dim() != 2 or values.shape[1] != d or values.shape[0] != major.shape[0]:
        raise ValueError(f"values must be [M, {d}] for M = {major.shape[0]} rows, got {list(values.shape)}")
    if values.shape[0] == 0:
        return
    x = _aligned(values.float())
    launch(store_rows_kernel, (x.shape[0],), (x, major, minor, table, codes, scales, per, width),
           consts, num_warps=4, num_stages=1)


def load_rows(fmt: EntryFormat, parts: list[torch.Tensor], major: torch.Tensor, minor: torch.Tensor,
              tables: torch.Tensor | None = None) -> torch.Tensor:
    """`dsl.cache.load_rows` in one launch: fp32 values [M, D] of the rows `store_rows` puts at (major, minor)."""
    (major, minor, table, codes, scales, per, width), consts, d = _layout(fmt, parts, major, minor, tables)
    out = torch.empty(major.shape[0], d, dtype=torch.float32, device=parts[0].device)
    if out.shape[0] == 0:
        return out
    launch(load_rows_kernel, (out.shape[0],), (codes, scales, major, minor, table, out, per, width),
           consts, num_warps=4, num_stages=1)
    return out


def trace(spec: CacheSpec, device: str = "meta") -> None:
    """Call both wrappers once for every cache of `spec` on empty pools of `device` (the AOT builder, on meta,
    records their launches: one variant per format and dim, whatever the number of rows)."""
    index = torch.zeros(1, dtype=torch.long, device=device)
    caches = [(fmt, dim, None) for _, dim, _, fmt in spec.windows]
    caches += [(fmt, dim, torch.zeros(1, 1, dtype=torch.long, device=device)) for _, _, dim, _, fmt in spec.compressed]
    for fmt, dim, tables in caches:
        with torch.device(device):
            parts = fmt.storage((1, 1), dim)
        store_rows(fmt, parts, torch.zeros(1, dim, device=device), index, index, tables)
        load_rows(fmt, parts, index, index, tables)


__all__ = ["KERNEL_NAMES", "load_rows", "load_rows_kernel", "store_rows", "store_rows_kernel", "trace"]
