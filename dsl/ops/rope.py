"""Interleaved rotary embedding on the trailing dims, plain or with YaRN, and its inverse.

Pairs are adjacent channels (v[2i], v[2i+1]) of the last `rope_dim` dims, rotated as complex numbers. The
frequencies follow the reference's `default` and `yarn` rope types; YaRN's magnitude scale is not applied
when `attention_factor` is 1 (V4.1's setting). A rope whose values go straight to a cache's rounding is fused with it
(`rope_fp8_round`, `rope_fp4_round`, `rope_entries_fp4_round`), and an RMS norm whose values go straight to such a
rope with both (`rms_norm_rope_fp8_round`, `rms_norm_rope_entries_fp4_round`).
"""

from __future__ import annotations

import functools
import math

import torch

from dsl import native
from dsl.context import cast
from dsl.ops.dense import _norm_type, rms_norm
from dsl.ops.registry import op, same_as_first
from dsl.ops.rounding import fp4_round, fp8_round
from dsl.ops.static_entries import StaticEntries, entry_positions
from dsl.ragged import Ragged

RopeParams = tuple[tuple[str, object], ...]  # sorted (key, value) items of a rope parameter dict: hashable


def rope_params(params: dict) -> RopeParams:
    return tuple(sorted(params.items()))


@functools.lru_cache(maxsize=64)
def inv_freq(params: RopeParams, rope_dim: int) -> tuple[torch.Tensor, float]:
    """The rotation frequencies [rope_dim / 2] (fp32) and the cos/sin magnitude factor."""
    p = dict(params)
    base = float(p["rope_theta"])
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim
    if p.get("rope_type", "default") == "default":
        return 1.0 / (base**exponents), 1.0
    factor = float(p["factor"])
    original = p["original_max_position_embeddings"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rope_dim, 2).float() / rope_dim)
    extrapolate = 1 - ramp  # share of each frequency kept unscaled
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention_factor)


@functools.lru_cache(maxsize=64)
def _freqs_on(params: RopeParams, rope_dim: int, device: torch.device) -> torch.Tensor:
    """`inv_freq`'s frequencies, copied to `device` once (a forward copies nothing; CUDA-graph capture allows no
    copy from host memory)."""
    return inv_freq(params, rope_dim)[0].to(device)


def rotate(x: torch.Tensor, positions: torch.Tensor, params: RopeParams, rope_dim: int, inverse: bool) -> torch.Tensor:
    """Rotate the last `rope_dim` dims of x [T, ..., D] at `positions` [T]."""
    return _rotated(x, _rotation(positions, params, rope_dim, x.device, inverse))


def _rotation(positions: torch.Tensor, params: RopeParams, rope_dim: int, device: torch.device,
              inverse: bool) -> torch.Tensor:
    """Each pair's rotation at `positions` [T], magnitude included: [T, rope_dim / 2, 2, 2], indexed [.., in, out]:
    a pair (even, odd) becomes (even * cos - odd * sin, even * sin + odd * cos), sin negated when `inverse`."""
    return rotation_at(positions, _freqs_on(params, rope_dim, device), inv_freq(params, rope_dim)[1], inverse)


def rotation_at(positions: torch.Tensor, freqs: torch.Tensor, magnitude: float, inverse: bool) -> torch.Tensor:
    """`_rotation` from the frequencies [rope_dim / 2] on the positions' device and the magnitude factor."""
    angles = positions.float()[:, None] * freqs[None, :]  # [T, rope_dim / 2]
    cos, sin = angles.cos(), angles.sin()
    if magnitude != 1.0:  # times 1.0 is exact: skipped
        cos, sin = cos * magnitude, sin * magnitude
    if inverse:
        sin = -sin
    return torch.stack([cos, sin, -sin, cos], dim=-1).unflatten(-1, (2, 2))


def _rotated(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with its last rope_dim dims rotated pair by pair by `rotation` [T, rope_dim / 2, 2, 2]. Each
    output is even * r[0] + odd * r[1], which is bitwise the written-out even * cos - odd * sin: subtracting is
    adding the negation, and negating a factor negates the rounded product. fp32 on the CPU runs the same products
    and sums in C (dsl/native.c)."""
    if (fast := native.rope(x, rotation)) is not None:
        return fast
    half = rotation.shape[-3]
    for _ in range(x.dim() + 2 - rotation.dim()):  # [T, rope_dim / 2, 2, 2] meets x [T, ..., D]
        rotation = rotation.unsqueeze(1)
    nope, pe = x[..., : -2 * half], x[..., -2 * half :]
    pairs = cast(pe, torch.float32).reshape(*pe.shape[:-1], half, 2, 1)
    even, odd = (pairs * rotation).unbind(-2)  # [T, ..., rope_dim / 2, out] each
    return torch.cat([nope, cast((even + odd).flatten(-2), x.dtype)], dim=-1)


@op("rope", same_as_first, uses_context=True)
def rope(x: torch.Tensor, *, params: RopeParams, rope_dim: int, inverse: bool = False, ctx) -> torch.Tensor:
    """Rotate each token's trailing `rope_dim` dims at its absolute position: x [N, ..., D] -> same. The rotation
    depends on the positions alone: made once per forward for each rope, direction and rank of x."""
    def make() -> torch.Tensor:
        rotation = _rotation(ctx.positions, params, rope_dim, x.device, inverse)
        for _ in range(x.dim() - 2):
            rotation = rotation.unsqueeze(1)
        return rotation
    return _rotated(x, ctx.memo(("rope", params, rope_dim, inverse, x.dim(), x.device), make))


@op("rope_entries", same_as_first, uses_context=True)
def rope_entries(x: Ragged, *, params: RopeParams, rope_dim: int, ratio: int, ctx) -> Ragged:
    """Rotate compressed entries at their group's first position: entry j of ratio r sits at j * r.

    The rotation depends on the entries' layout alone, which a layer's KV entries and index keys share: it is made
    once per forward, from their entry indices (`ForwardContext.entry_layout`); a static step's entries
    (dsl/ops/static_entries.py) at their rows' entry indices."""
    if isinstance(x, StaticEntries):
        positions = entry_positions(x.step, ratio)
        return x.replace(_rotated(x.values, _rotation(positions, params, rope_dim, x.values.device, inverse=False)))
    if not x.values.shape[0]:  # no entry completed (most decode steps): nothing to rotate
        return x

    def make() -> torch.Tensor:
        _, _, _, index = ctx.entry_layout(x.first, x.counts)  # [E] entry indices
        device = x.values.device
        return _rotation(cast(index, device=device) * ratio, params, rope_dim, device, inverse=False)
    key = ("rope entries", params, rope_dim, ratio, tuple(x.first), tuple(x.counts), x.values.device)
    return x.replace(_rotated(x.values, ctx.memo(key, make)))


# A rope whose output only a rounding reads becomes one op, and so does an RMS norm whose output only such a rope
# reads (dsl/passes/fuse.py; one kernel on the GPU targets, no round trip through memory between them): each is the
# references in turn.
@op("rope_fp8_round", same_as_first, uses_context=True)
def rope_fp8_round(x: torch.Tensor, *, params: RopeParams, rope_dim: int, inverse: bool = False, block: int = 32,
                   ctx) -> torch.Tensor:
    """`rope`, then `fp8_round`."""
    return fp8_round(rope(x, params=params, rope_dim=rope_dim, inverse=inverse, ctx=ctx), block=block)


@op("rope_fp4_round", same_as_first, uses_context=True)
def rope_fp4_round(x: torch.Tensor, *, params: RopeParams, rope_dim: int, inverse: bool = False, block: int,
                   e4m3_scale: bool, ctx) -> torch.Tensor:
    """`rope`, then `fp4_round`."""
    return fp4_round(rope(x, params=params, rope_dim=rope_dim, inverse=inverse, ctx=ctx), block=block,
                     e4m3_scale=e4m3_scale)


@op("rope_entries_fp4_round", same_as_first, uses_context=True)
def rope_entries_fp4_round(x: Ragged, *, params: RopeParams, rope_dim: int, ratio: int, block: int, e4m3_scale: bool,
                           ctx) -> Ragged:
    """`rope_entries`, then `fp4_round`."""
    return fp4_round(rope_entries(x, params=params, rope_dim=rope_dim, ratio=ratio, ctx=ctx), block=block,
                     e4m3_scale=e4m3_scale)


@op("rms_norm_rope_fp8_round", _norm_type, uses_context=True)
def rms_norm_rope_fp8_round(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float, params: RopeParams,
                            rope_dim: int, inverse: bool = False, block: int = 32, ctx) -> torch.Tensor:
    """`rms_norm`, then `rope_fp8_round`."""
    return rope_fp8_round(rms_norm(x, w, eps=eps), params=params, rope_dim=rope_dim, inverse=inverse, block=block,
                          ctx=ctx)


@op("rms_norm_rope_entries_fp4_round", _norm_type, uses_context=True)
def rms_norm_rope_entries_fp4_round(x: Ragged, w: torch.Tensor | None = None, *, eps: float, params: RopeParams,
                                    rope_dim: int, ratio: int, block: int, e4m3_scale: bool, ctx) -> Ragged:
    """`rms_norm`, then `rope_entries_fp4_round`."""
    return rope_entries_fp4_round(rms_norm(x, w, eps=eps), params=params, rope_dim=rope_dim, ratio=ratio, block=block,
                                  e4m3_scale=e4m3_scale, ctx=ctx)
