"""Weight storage formats of DeepSeek-V4.1 checkpoints: fp8 e4m3 and fp4 e2m1 with power-of-two (ue8m0) scales.

Formats (every scale is a power of two; stored as float32 or `torch.float8_e8m0fnu`, both accepted):
- fp8 block: `w[O, I]` in float8_e4m3fn, one scale per 32 x 32 block, `scale[ceil(O/32), ceil(I/32)]`.
  The Engram tables use the same e4m3 codes with one scale per 32 values of a row, `scale[O, ceil(I/32)]`
  (`dequantize_fp8_group`).
- fp4 group: `w[O, I]` in e2m1, one scale per 32 consecutive input values, `scale[O, ceil(I/32)]`. Two codes per
  byte, `packed[O, I/2]` uint8: the low nibble holds the even column, the high nibble the odd one (the order of the
  OCP MX spec and of torch.float4_e2m1fn_x2). A code is sign (bit 3) and a magnitude index (bits 0-2) into
  {0, 0.5, 1, 1.5, 2, 3, 4, 6}; negative values that round to zero keep their sign (code 8, -0.0).

The scale of a block is 2^ceil(log2(amax / qmax)) with amax clamped to a floor, computed from the fp32 bits
(exponent - 127, plus one when the mantissa is non-zero), so it matches a kernel bit for bit.
"""

from __future__ import annotations

import functools

import torch

BLOCK = 32
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = FP4_MAX * 2.0**-126  # keeps amax / 6 a normal float, so the scale fits ue8m0
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring grid values and whether a tie rounds up: ties go to the even code.
_FP4_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_PACKED_DTYPES = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive normal fp32 `x`, exactly, from the float's bits."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A scale tensor as fp32: ue8m0 bytes decode to 2^(byte - 127) (255 is NaN); float scales are upcast."""
    if scale.dtype == torch.float8_e8m0fnu:
        byte = scale.view(torch.uint8).to(torch.int32)
        value = torch.ldexp(torch.ones_like(byte, dtype=torch.float32), byte - 127)
        return torch.where(byte == 255, torch.full_like(value, float("nan")), value)
    if not scale.is_floating_point() or scale.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"a scale must be float32/bf16/fp16 or float8_e8m0fnu, got {scale.dtype}")
    return scale.float()


def _blocks_amax(w: torch.Tensor, rows: int) -> torch.Tensor:
    """max |w| over blocks of `rows` x 32 (edges padded with zeros): [ceil(O/rows), ceil(I/32)]."""
    o, i = w.shape
    padded = torch.nn.functional.pad(w.float().abs(), (0, -i % BLOCK, 0, -o % rows))
    return padded.unflatten(1, (-1, BLOCK)).unflatten(0, (-1, rows)).amax(dim=(1, 3))


def _expand(scale: torch.Tensor, rows: int, shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(rows, dim=0).repeat_interleave(BLOCK, dim=1)[: shape[0], : shape[1]]


def _check_2d(w: torch.Tensor, what: str) -> None:
    if w.dim() != 2:
        raise ValueError(f"{what} needs a 2-D weight [O, I], got shape {list(w.shape)}")


def _quantize_fp8(w: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    _check_2d(w, "fp8 quantization")
    scale = pow2_ceil(_blocks_amax(w, rows).clamp_min(FP8_AMAX_FLOOR) / FP8_MAX)
    q = (w.float() / _expand(scale, rows, w.shape)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn), scale


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `w[O, I]` to e4m3 with one power-of-two scale per 32 x 32 block.

    Returns `(w_fp8 [O, I] float8_e4m3fn, scale [ceil(O/32), ceil(I/32)] fp32)`; codes are round-to-nearest-even
    of `clamp(w / scale, ±448)`.
    """
    return _quantize_fp8(w, BLOCK)


def quantize_fp8_group(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `w[O, I]` to e4m3 with one power-of-two scale per 32 values of a row (the Engram table format).

    Returns `(w_fp8 [O, I] float8_e4m3fn, scale [O, ceil(I/32)] fp32)`.
    """
    return _quantize_fp8(w, 1)


def _check_scale(w: torch.Tensor, scale: torch.Tensor, want: tuple[int, int], what: str) -> None:
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: weight {list(w.shape)} needs a scale of shape {list(want)}, "
                         f"got {list(scale.shape)}")


def dequantize_fp8_block(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 `w[O, I]` from e4m3 codes and their 32 x 32 block scales `[ceil(O/32), ceil(I/32)]`."""
    _check_2d(w, "fp8 dequantization")
    o, i = w.shape
    _check_scale(w, scale, (-(-o // BLOCK), -(-i // BLOCK)), "fp8 block dequantization")
    return w.float() * _expand(scale_to_float(scale), BLOCK, w.shape)


def dequantize_fp8_group(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 `w[O, I]` from e4m3 codes and one scale per 32 values of a row, `scale[O, ceil(I/32)]`."""
    _check_2d(w, "fp8 dequantization")
    o, i = w.shape
    _check_scale(w, scale, (o, -(-i // BLOCK)), "fp8 group dequantization")
    return w.float() * _expand(scale_to_float(scale), 1, w.shape)


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 in [0, 16)) of `x`, already divided by its scale: nearest grid value, ties to even code."""
    mag = x.float().abs().clamp(max=FP4_MAX)
    index = torch.zeros_like(mag, dtype=torch.uint8)
    for midpoint, tie_up in _FP4_MIDPOINTS:
        index += (mag >= midpoint if tie_up else mag > midpoint).to(torch.uint8)
    return index | ((x < 0).to(torch.uint8) << 3)


@functools.lru_cache(maxsize=8)
def _fp4_grid(device: torch.device) -> torch.Tensor:
    return torch.tensor(FP4_GRID, dtype=torch.float32, device=device)


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (uint8 in [0, 16))."""
    mag = _fp4_grid(codes.device)[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def quantize_fp4_group(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `w[O, I]` (I even) to e2m1 with one power-of-two scale per 32 consecutive input values.

    Returns `(packed [O, I/2] uint8, scale [O, ceil(I/32)] fp32)`, scale = 2^ceil(log2(max(amax, 6·2^-126) / 6)).
    """
    _check_2d(w, "fp4 quantization")
    if w.shape[1] % 2:
        raise ValueError(f"fp4 packing needs an even number of columns, got shape {list(w.shape)}")
    scale = pow2_ceil(_blocks_amax(w, 1).clamp_min(FP4_AMAX_FLOOR) / FP4_MAX)
    codes = fp4_codes(w.float() / _expand(scale, 1, w.shape))
    return codes[:, 0::2] | (codes[:, 1::2] << 4), scale


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Codes `[O, 2 * I/2]` from packed bytes `[O, I/2]` (uint8, int8 or float4_e2m1fn_x2): low nibble first."""
    if packed.dtype not in _PACKED_DTYPES:
        raise ValueError(f"packed fp4 must be uint8, int8 or float4_e2m1fn_x2, got {packed.dtype}")
    byte = packed.view(torch.uint8)
    return torch.stack((byte & 0xF, byte >> 4), dim=-1).flatten(-2)


def dequantize_fp4_group(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 `w[O, I]` from packed e2m1 codes `[O, I/2]` and their scales `[O, ceil(I/32)]`."""
    _check_2d(packed, "fp4 dequantization")
    o, half = packed.shape
    shape = torch.Size((o, 2 * half))
    _check_scale(packed, scale, (o, -(-shape[1] // BLOCK)), f"fp4 dequantization (logical shape {list(shape)})")
    return fp4_values(unpack_fp4(packed)) * _expand(scale_to_float(scale), 1, shape)


def dequantize(weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 value of a stored weight, whatever its format.

    float8_e4m3fn: 32 x 32 block scales, or one scale per 32 values of a row (told apart by the scale's shape);
    uint8 / int8 / float4_e2m1fn_x2: packed fp4 with one scale per 32 values; any other float dtype: `.float()`.
    """
    if weight.dtype == torch.float8_e4m3fn:
        if scale is None:
            raise ValueError(f"an fp8 weight of shape {list(weight.shape)} needs its scale")
        _check_2d(weight, "fp8 dequantization")
        o, i = weight.shape
        if tuple(scale.shape) == (o, -(-i // BLOCK)):
            return dequantize_fp8_group(weight, scale)
        return dequantize_fp8_block(weight, scale)
    if weight.dtype in _PACKED_DTYPES:
        if scale is None:
            raise ValueError(f"a packed fp4 weight of shape {list(weight.shape)} needs its scale")
        return dequantize_fp4_group(weight, scale)
    if not weight.is_floating_point():
        raise ValueError(f"cannot dequantize a {weight.dtype} tensor of shape {list(weight.shape)}")
    return weight.float()
