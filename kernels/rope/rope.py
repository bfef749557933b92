"""Interleaved rotary embedding (`dsl.ops.rope.rope`) in one pass: out = x with the pairs (v[2i], v[2i+1]) of its
last `rope_dim` dims rotated by position * freq_i (times YaRN's magnitude; sin negated for the inverse).

x [N, ..., D] is read once and written once: each program takes `block_R` rows of D values (rows: the dims between
the token and D, heads for q), loads them and the same tile with every column's pair partner (column j ^ 1, from
L1), and writes x where a column is not rotated and c * x + s * partner (the partner's sign by parity) where it
is. The angles are the reference's: fp32 position times fp32 frequency (`dsl.ops.rope._freqs_on`), then cos and
sin, one per column a program. torch's reference makes the [N, ..., rope_dim / 2, 2, 2] products and a copy of the
unrotated dims (`torch.cat`): about 1.5x x's bytes over the two on top of the read and the write, in six launches.

`rope_round_kernel` also rounds the rotated rows onto a cache's grid (fp8, or fp4 with either scale), the rounding
that reads the model's rotated kv, indexer queries and compressed entries alone (the ops `rope_fp8_round`,
`rope_fp4_round` and `rope_entries_fp4_round`, made by dsl/passes/fuse.py): one launch and one pass over memory
where there were two. Where an RMS norm's output goes to such a rope alone (the window's kv, the indexer's keys:
`rms_norm_rope_fp8_round`, `rms_norm_rope_entries_fp4_round`) it norms each row first, one launch for three.

Numerics: the products and the sum are those of the reference in fp32, but the compiler may fuse a product and the
sum into one FMA (one rounding less), so results can differ from torch's in the last bit. A row's result depends
only on the row, its position and the frequencies: any batch, padded or not.
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.rounding.rounding import fp4_blocks, fp8_blocks


@triton.jit
def _rotated_tile(x_ptr, pos_ptr, freq_ptr, w_ptr, R, D: tl.constexpr, NOPE: tl.constexpr, MAGNITUDE: tl.constexpr,
                  INVERSE: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr,
                  block_R: tl.constexpr, block_D: tl.constexpr):
    """This program's rows of token program_id(0) (RMS-normed first with NORM: fp32, times w [D] with HAS_W), rotated:
    [block_R, block_D] in x's dtype, fp32 with NORM (zeros outside x), their offsets and mask."""
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * block_R + tl.arange(0, block_R)
    cols = tl.arange(0, block_D)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    offs = (t * R + rows.to(tl.int64))[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    rotated = cols >= NOPE
    pair = tl.where(rotated, cols - NOPE, 0) // 2
    first = tl.where(rotated, cols - NOPE, 0) % 2 == 0  # a pair's first (even) column
    step = tl.where(first, 1, -1)  # to the partner
    partner = tl.load(x_ptr + offs + step[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
    if NORM:  # kernels/norm/rms_norm.py's arithmetic, a row at a time; the partners get their own columns' weights
        x = x.to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=1) / D + EPS)[:, None]
        x = x * r
        partner = partner * r
        if HAS_W:
            x = x * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
            w_partner = tl.load(w_ptr + cols + step, mask=rotated & (cols < D), other=0.0).to(tl.float32)
            partner = partner * w_partner[None, :]
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + pair, mask=rotated & (cols < D), other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    if MAGNITUDE != 1.0:
        cos, sin = cos * MAGNITUDE, sin * MAGNITUDE
    if INVERSE:
        sin = -sin
    # even column: even * cos + odd * -sin; odd column: even * sin + odd * cos (the reference's order of terms)
    xf = x.to(tl.float32)
    out = tl.where(first[None, :], xf * cos[None, :] + partner * -sin[None, :],
                   partner * sin[None, :] + xf * cos[None, :])
    return tl.where(rotated[None, :], out.to(x.dtype), x), offs, mask


@triton.jit(do_not_specialize=["R"])
def rope_kernel(x_ptr, pos_ptr, freq_ptr, out_ptr, R, D: tl.constexpr, NOPE: tl.constexpr, MAGNITUDE: tl.constexpr,
                INVERSE: tl.constexpr, block_R: tl.constexpr, block_D: tl.constexpr):
    pdl_prologue()
    out, offs, mask = _rotated_tile(x_ptr, pos_ptr, freq_ptr, x_ptr, R, D, NOPE, MAGNITUDE, INVERSE, False, 0.0, False,
                                    block_R, block_D)
    tl.store(out_ptr + offs, out, mask=mask)


@triton.jit(do_not_specialize=["R"])
def rope_round_kernel(x_ptr, pos_ptr, freq_ptr, w_ptr, out_ptr, R, D: tl.constexpr, NOPE: tl.constexpr,
                      MAGNITUDE: tl.constexpr, INVERSE: tl.constexpr, NORM: tl.constexpr, EPS: tl.constexpr,
                      HAS_W: tl.constexpr, FP8: tl.constexpr, BLOCK: tl.constexpr, E4M3_SCALE: tl.constexpr,
                      block_R: tl.constexpr, block_D: tl.constexpr):
    """`rope_kernel` (each row RMS-normed first with NORM), then the rotated rows (in x's dtype, as rope writes them;
    fp32 with NORM) rounded in blocks of BLOCK along D: `fp8_round` (FP8) or `fp4_round` (E4M3_SCALE its scale),
    kernels/rounding/rounding.py's arithmetic on the tile; BLOCK 0 rounds nothing."""
    pdl_prologue()
    out, offs, mask = _rotated_tile(x_ptr, pos_ptr, freq_ptr, w_ptr, R, D, NOPE, MAGNITUDE, INVERSE, NORM, EPS, HAS_W,
                                    block_R, block_D)
    if BLOCK == 0:  # not rounded (the dim is no multiple of the rounding's block): normed and rotated
        tl.store(out_ptr + offs, out, mask=mask)
    else:
        blocks = tl.reshape(out.to(tl.float32), [block_R * block_D // BLOCK, BLOCK])  # D is a multiple of BLOCK
        if FP8:
            y = fp8_blocks(blocks)
        else:
            y = fp4_blocks(blocks, E4M3_SCALE)
        tl.store(out_ptr + offs, tl.reshape(y, [block_R, block_D]).to(out_ptr.dtype.element_ty), mask=mask)


def default_config(rows: int, d: int) -> dict:
    """`block_R` rows a program: about 4096 values (16 KB of fp32) in 4 warps, fewer where a token has fewer rows."""
    block_d = triton.next_power_of_2(d)
    return {"block_R": max(1, min(triton.next_power_of_2(rows), 4096 // block_d)), "num_warps": 4}


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, magnitude: float = 1.0,
         inverse: bool = False, config: dict | None = None) -> torch.Tensor:
    """x [N, ..., D] (fp32 or bf16, contiguous) with its last 2 * len(freqs) dims rotated pair by pair at positions
    [N] (int64): a new tensor of x's shape and dtype."""
    return _launch(rope_kernel, x, positions, freqs, magnitude, inverse, {}, config)


def rope_round(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, *, fp8: bool, block: int,
               e4m3_scale: bool = False, magnitude: float = 1.0, inverse: bool = False, norm: bool = False,
               w: torch.Tensor | None = None, eps: float = 0.0, config: dict | None = None) -> torch.Tensor:
    """`rope`, then `fp8_round` (`fp8`) or `fp4_round` (`e4m3_scale` its scale) in blocks of `block` along D, in one
    launch: bit for bit `kernels.rounding`'s kernel over `rope`'s output. `block` a power of two dividing D, or 0: no
    rounding (where the model's rounding returns x). With `norm`, each row [D] is RMS-normed first (times w [D] where
    given; `eps`) with `kernels.norm.rms_norm`'s arithmetic, its squares summed over the tile's row (the interpreter
    gives that kernel's bits; a GPU may add them in another order), and the result is fp32."""
    d = x.shape[-1] if x.dim() else 0
    if block < 0 or block & (block - 1) or (block and d % block):
        raise ValueError(f"rope_round's block must be 0 or a power of two dividing the last dim {d}, got {block}")
    if w is not None and (not norm or tuple(w.shape) != (d,) or not w.is_contiguous() or w.device != x.device):
        raise ValueError(f"rope_round's norm weight must be contiguous [{d}] on {x.device} and go with norm, got "
                         f"{list(w.shape)} (norm {norm})")
    consts = {"NORM": bool(norm), "EPS": float(eps), "HAS_W": w is not None, "FP8": bool(fp8), "BLOCK": block,
              "E4M3_SCALE": bool(e4m3_scale) and not fp8}
    return _launch(rope_round_kernel, x, positions, freqs, magnitude, inverse, consts, config, w=x if w is None else w,
                   dtype=torch.float32 if norm else None)


def _launch(kernel, x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, magnitude: float, inverse: bool,
            consts: dict, config: dict | None, w: torch.Tensor | None = None,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    if x.dim() < 2 or not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rope needs a contiguous float32/bfloat16 x [N, ..., D], got {x.dtype} {list(x.shape)}")
    n, d = x.shape[0], x.shape[-1]
    half = freqs.shape[0] if freqs.dim() == 1 else -1
    if half < 1 or 2 * half > d or freqs.dtype != torch.float32 or not freqs.is_contiguous():
        raise ValueError(f"rope's freqs must be contiguous float32 [rope_dim / 2] with rope_dim <= {d}, got "
                         f"{freqs.dtype} {list(freqs.shape)}")
    if tuple(positions.shape) != (n,) or positions.dtype != torch.int64:
        raise ValueError(f"rope's positions must be int64 [{n}], got {positions.dtype} {list(positions.shape)}")
    rows = x[0].numel() // d if n else 1
    config = config or default_config(rows, d)
    out = torch.empty_like(x, dtype=dtype or x.dtype)
    if x.numel() == 0:
        return out
    args = (x, positions, freqs, out, rows) if w is None else (x, positions, freqs, w, out, rows)
    launch(kernel, (n, triton.cdiv(rows, config["block_R"])), args,
           dict(D=d, NOPE=d - 2 * half, MAGNITUDE=float(magnitude), INVERSE=bool(inverse)) | consts
           | dict(block_R=config["block_R"], block_D=triton.next_power_of_2(d)), config["num_warps"], 1)
    return out


__all__ = ["default_config", "rope", "rope_round"]
