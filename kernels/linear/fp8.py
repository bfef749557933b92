"""fp8 x fp8 linear for prefill: activations rounded to e4m3 per token, weights per output row, one wgmma GEMM.

The 32x32-block weight of the checkpoint cannot feed Hopper's fp8 tensor cores directly (its scales change every 32
values of K), so `linear` converts W to bf16 in registers and runs at a fifth of `torch._scaled_mm`. Here both
operands are plain e4m3 with one scale per row, so the product is (xq @ wq^T) * sx[:, None] * sw[None, :]: an fp8
GEMM with fp32 accumulation and the scales applied once, in the epilogue.

- `quantize_rows(x)`: sx = 2^ceil(log2(max(amax(|x_row|), 1e-4) / 448)), xq = e4m3(clamp(x / sx, ±448)). A power of
  two, not amax / 448: x / sx is then exact, so the e4m3 rounding is the only error and the codes are reproducible
  (bit for bit the torch reference, on any device), and sx is a ue8m0 value like the checkpoint's scales. The cost
  is headroom: the row's max lands in (224, 448] instead of on 448, which e4m3, a float format, barely notices (its
  relative step is 2^-3 at every normal magnitude). Elements more than ~2^15 below the row's max fall into e4m3's
  subnormals or to zero (2^-9 * sx is the smallest code); that is where a per-token scale loses precision, and the
  only new error of this path (relative L2 ~2-3e-2 on Gaussian rows, from the 3 mantissa bits).
- `rowwise_weight(w, scale)` (load time, torch): a 32-row block's scales are powers of two, so its largest,
  2^Emax, becomes the scale of its rows and the codes of blocks with a smaller scale 2^e are shifted down by
  2^(e - Emax). Exact when a row block's scales agree; otherwise a shifted code can fall below e4m3's normal range
  (2^-6) and rounds to the nearest 2^-9 step: an error of at most 2^-10 * sw per element.
- e4m3 rows (`e4m3_rows`, `unpack_rows`): a row's codes and its scale packed in one uint8 row, so a producer that
  holds the row in registers (the RMSNorms of kernels/norm/e4m3.py, `store_e4m3_row`) rounds it as
  `quantize_rows` would and hands the linears one plain tensor ([M, bytes], what CUDA-graph segments pass between
  nodes). A row is its K codes, zeros up to a multiple of 16 bytes, its fp32 scale and 12 zero bytes (the producers
  write every byte: a row's bytes are reproducible): the codes, the scales and every row start 16-byte aligned, as the
  cubin launcher wants of pointers and the GEMM of its loads. The GEMM reads the codes with a row stride.
- `linear_rowwise(xq, sx, wq, sw)`: tiles of block_M x block_N, K in block_K steps with `tl.dot` on e4m3 operands
  (A [block_M, block_K] and W [block_N, block_K] both K-contiguous, as sm_90's fp8 wgmma needs), tiles visited in
  groups of `group_M` row tiles so a group's W tiles stay in L2. No split-K and block_K is the same in every config,
  so a row's result does not depend on how many rows come with it (on the GPU every tile config gives the same
  bits). `promote_K` (a multiple of 32 up to block_K) adds the tensor cores' partial sums into the fp32
  accumulator every promote_K values of K. Hopper's fp8 MMA adds with fewer bits than fp32, so the default 0, which
  leaves the whole K to it (cuBLAS's "fast accumulation"), is as far off exact fp32 sums as
  `_scaled_mm(use_fast_accum=True)`, little next to the activations' own rounding; promote_K=128 is as close as
  `_scaled_mm`'s default but slower (the partial accumulator doubles the registers). bench/RESULTS.md has both.
"""

from __future__ import annotations

import torch

from dsl.quant import BLOCK, FP8_AMAX_FLOOR, FP8_MAX, pow2_ceil, scale_to_float
from kernels.cache.rows import _e4m3_bits
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.tiles import grouped_tile, tile_dot

FP8 = torch.float8_e4m3fn
SMEM_BUDGET = 227 * 1024  # per block on sm_90


@triton.jit
def _store_codes(q_ptr, ks, x, inv, K: tl.constexpr):
    q = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)  # x * 2^-e is exact; the clamp catches amax / 448 rounded down
    tl.store(q_ptr + ks, _e4m3_bits(q).to(tl.uint8), mask=ks < K)


@triton.jit
def _row_scale(amax):
    """amax [1] of a row -> (sx, 1 / sx), both [1] fp32: sx = 2^ceil(log2(max(amax, 1e-4) / 448)), exactly."""
    a = tl.maximum(amax, 1e-4)  # FP8_AMAX_FLOOR
    bits = tl.math.div_rn(a, tl.full([1], 448.0, tl.float32)).to(tl.int32, bitcast=True)
    byte = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # sx = 2^(byte - 127), byte in [105, 247]
    return (byte << 23).to(tl.float32, bitcast=True), ((254 - byte) << 23).to(tl.float32, bitcast=True)


@triton.jit
def store_e4m3_row(q_ptr, s_ptr, x, offs, ROW: tl.constexpr):
    """A row held whole in registers, x [block] fp32 at columns `offs` (0 past its values, block >= ROW - 16), rounded
    as `quantize_rows` and written whole as an e4m3 row of ROW bytes: codes to q_ptr + offs (uint8, zeros up to the
    scale), the scale and three zero words to s_ptr [4] (fp32)."""
    sx, inv = _row_scale(tl.max(tl.abs(x), axis=0, keep_dims=True))
    tl.store(s_ptr + tl.arange(0, 4), tl.where(tl.arange(0, 4) == 0, sx, 0.0))
    _store_codes(q_ptr, offs, x, inv, ROW - 16)


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K: tl.constexpr, block_K: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * K, q_ptr + row * K
    offs = tl.arange(0, block_K)
    x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)  # the first (usually only) chunk stays here
    amax = tl.abs(x)
    for k0 in tl.range(block_K, K, block_K):
        ks = k0 + offs
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)))
    sx, inv = _row_scale(tl.max(amax, axis=0, keep_dims=True))
    tl.store(s_ptr + row + tl.arange(0, 1), sx)
    _store_codes(q_row, offs, x, inv, K)
    for k0 in tl.range(block_K, K, block_K):
        ks = k0 + offs
        _store_codes(q_row, ks, tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32), inv, K)


def quantize_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference of `quantize_rows`: (xq [M, K] float8_e4m3fn, sx [M] float32)."""
    x = x.float()  # [M, K]
    amax = x.abs().amax(dim=1).clamp_min(FP8_AMAX_FLOOR)  # [M]
    sx = pow2_ceil(amax / torch.full_like(amax, FP8_MAX))  # tensor / tensor: IEEE division on every device
    q = (x / sx[:, None]).clamp(-FP8_MAX, FP8_MAX)  # clamp first: torch versions differ on e4m3 overflow
    return q.to(FP8), sx


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3: x [M, K] float32 / bfloat16, contiguous, finite -> (xq [M, K] float8_e4m3fn, sx [M] float32).

    sx = 2^ceil(log2(max(amax(|x_row|), 1e-4) / 448)); xq = round-to-nearest-even e4m3 of clamp(x / sx, ±448), bit
    for bit `quantize_rows_ref`. A non-finite element leaves its row's codes and scale unspecified.
    """
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"quantize_rows needs x [M, K] with K > 0, got {list(x.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise TypeError(f"quantize_rows needs contiguous float32 or bfloat16 x, got {x.dtype}")
    m, k = x.shape
    xq = torch.empty(m, k, dtype=FP8, device=x.device)
    sx = torch.empty(m, dtype=torch.float32, device=x.device)
    block_k = min(triton.next_power_of_2(k), 8192)
    launch(quantize_rows_kernel, (m,), (x, xq.view(torch.uint8), sx), {"K": k, "block_K": block_k},
           num_warps=8 if block_k >= 4096 else 4, num_stages=1)
    return xq, sx


def _codes_bytes(k: int) -> int:
    return -(-k // 16) * 16


def e4m3_rows(m: int, k: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """m empty e4m3 rows of k values (module docstring): (rows uint8 [m, bytes], their codes as xq float8_e4m3fn
    [m, k] and scales as sx float32 [m], views of rows with a row stride, as `linear_rowwise` takes them)."""
    rows = torch.empty(m, _codes_bytes(k) + 16, dtype=torch.uint8, device=device)
    return (rows, *unpack_rows(rows, k))


def unpack_rows(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes and scales of e4m3 rows of k values, rows uint8 [M, bytes]: (xq float8_e4m3fn [M, k], sx float32
    [M]), views."""
    kp = _codes_bytes(k)
    if rows.dim() != 2 or rows.dtype != torch.uint8 or tuple(rows.shape[1:]) != (kp + 16,) or rows.stride(1) != 1:
        raise ValueError(f"e4m3 rows of {k} values are uint8 [M, {kp + 16}] with unit column stride, got {rows.dtype} "
                         f"{list(rows.shape)}")
    return rows[:, :k].view(FP8), rows[:, kp:kp + 4].view(torch.float32)[:, 0]


def rowwise_weight(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A 32x32-block fp8 weight as one scale per output row: (wq [N, K] float8_e4m3fn, sw [N] float32).

    w [N, K] float8_e4m3fn with scale [ceil(N/32), ceil(K/32)] (float32 or float8_e8m0fnu powers of two). Each
    32-row block's largest scale 2^Emax becomes sw for its rows; codes of a block with scale 2^e are multiplied by
    2^(e - Emax) and rounded to e4m3 (nearest even). Exact where a row block's scales agree; elsewhere
    |wq * sw - w * scale| <= 2^-10 * sw, reached only by codes the shift moves below e4m3's normals (< 2^-6).
    """
    if w.dim() != 2 or w.dtype != FP8:
        raise TypeError(f"rowwise_weight needs a 2-D float8_e4m3fn weight, got {w.dtype} {list(w.shape)}")
    n, k = w.shape
    want = (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"weight {list(w.shape)} needs block scales of shape {list(want)}, got {list(scale.shape)}")
    s = scale_to_float(scale).to(w.device)  # [N/32, K/32]
    mantissa, _ = torch.frexp(s)
    if not (torch.isfinite(s).all() and (mantissa == 0.5).all()):
        raise ValueError("rowwise_weight needs power-of-two block scales (ue8m0), as the checkpoint stores")
    smax = s.amax(dim=1)  # [N/32]: 2^Emax
    shift = (s / smax[:, None]).repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]  # 2^(e - Emax)
    wq = (w.float() * shift).to(FP8)  # |w| <= 448 and shift <= 1: never overflows
    return wq, smax.repeat_interleave(BLOCK)[:n].contiguous()


@triton.jit(do_not_specialize=["M"])
def linear_rowwise_kernel(a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr,
                          stride_A: tl.constexpr, stride_SA: tl.constexpr, block_M: tl.constexpr,
                          block_N: tl.constexpr, block_K: tl.constexpr, group_M: tl.constexpr,
                          promote_K: tl.constexpr):
    pdl_prologue()
    offs_m, offs_n = grouped_tile(M, N, block_M, block_N, group_M)
    acc = tile_dot(a_ptr, b_ptr, offs_m, offs_n, M, N, K, stride_A, block_M, block_N, block_K, promote_K)
    rows_a, rows_b = offs_m % M, offs_n % N
    sa = tl.load(sa_ptr + rows_a * stride_SA)  # [block_M]
    sb = tl.load(sb_ptr + rows_b)  # [block_N]
    out = acc * sa[:, None] * sb[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


def smem_bytes(config: dict) -> int:
    """Shared memory of a config's pipelined A and W tiles (one byte per e4m3 value)."""
    return config["num_stages"] * config["block_K"] * (config["block_M"] + config["block_N"])


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """The heuristic tile for `m` tokens (a bucket's upper end) and a weight [n, k]; block_K is always 128.

    m <= 64: 64-row tiles (one warpgroup's wgmma), W streamed. Larger m: 128 x 256 tiles (3 stages, 144 KB) when
    they make two waves or more, else 128 x 128 (4 stages): fewer, larger tiles leave SMs idle in the last wave.
    promote_K=0: see the module docstring.
    """
    if m <= 64:
        block_m, block_n, warps, stages = 64, 128 if triton.cdiv(n, 128) >= num_sms else 64, 4, 4
    elif triton.cdiv(m, 128) * triton.cdiv(n, 256) >= 2 * num_sms:
        block_m, block_n, warps, stages = 128, 256, 8, 3
    else:
        block_m, block_n, warps, stages = 128, 128, 8, 4
    return {"block_M": block_m, "block_N": block_n, "block_K": 128, "group_M": 8, "promote_K": 0,
            "num_warps": warps, "num_stages": stages}


def _check(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, out_dtype: torch.dtype,
           config: dict) -> None:
    if xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        raise ValueError(f"linear_rowwise needs xq [M, K] and wq [N, K], got {list(xq.shape)} and {list(wq.shape)}")
    if xq.dtype != FP8 or wq.dtype != FP8:
        raise TypeError(f"xq and wq must be float8_e4m3fn, got {xq.dtype} and {wq.dtype}")
    if tuple(sx.shape) != xq.shape[:1] or tuple(sw.shape) != wq.shape[:1]:
        raise ValueError(f"sx must be [M] = [{xq.shape[0]}] and sw [N] = [{wq.shape[0]}], "
                         f"got {list(sx.shape)} and {list(sw.shape)}")
    if sx.dtype != torch.float32 or sw.dtype != torch.float32:
        raise TypeError(f"sx and sw must be float32, got {sx.dtype} and {sw.dtype}")
    if not (wq.is_contiguous() and sw.is_contiguous() and xq.stride(1) == 1 and xq.stride(0) >= xq.shape[1]):
        raise ValueError("linear_rowwise needs contiguous wq and sw, and rows of xq with unit column stride")
    if len({t.device for t in (xq, sx, wq, sw)}) != 1:
        raise ValueError(f"operands on several devices: {[str(t.device) for t in (xq, sx, wq, sw)]}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    promote = config.get("promote_K", 0)
    if config["block_K"] % 32 or promote % 32 or promote > config["block_K"]:
        raise ValueError(f"block_K and promote_K are multiples of 32, promote_K <= block_K, got {config}")
    if smem_bytes(config) > SMEM_BUDGET:
        raise ValueError(f"config needs {smem_bytes(config)} bytes of shared memory, over {SMEM_BUDGET}: {config}")


def linear_rowwise(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                   out_dtype: torch.dtype = torch.float32, config: dict | None = None) -> torch.Tensor:
    """out [M, N] = (xq [M, K] @ wq [N, K]^T) * sx [M, None] * sw [None, N], accumulated in fp32.

    xq, wq: float8_e4m3fn; sx, sw: float32 (from `quantize_rows` and `rowwise_weight`), on one device; wq and sw
    contiguous, xq's rows and sx strided or not (`unpack_rows` gives e4m3 rows' codes and scales as views).
    out_dtype: float32 or bfloat16 (rounded to nearest even once, after scaling).
    """
    m, n = (xq.shape[0] if xq.dim() == 2 else 0), (wq.shape[0] if wq.dim() == 2 else 0)
    k = xq.shape[-1]
    config = config or default_config(max(m, 1), n, k)
    _check(xq, sx, wq, sw, out_dtype, config)
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    grid = (triton.cdiv(m, config["block_M"]) * triton.cdiv(n, config["block_N"]),)
    tile = {name: config[name] for name in ("block_M", "block_N", "block_K")}
    launch(linear_rowwise_kernel, grid, (xq, wq, sx, sw, out, m),
           {"N": n, "K": k, "stride_A": xq.stride(0), "stride_SA": sx.stride(0), **tile,
            "group_M": config.get("group_M", 8), "promote_K": config.get("promote_K", 0)},
           config["num_warps"], config["num_stages"])
    return out


def linear_rowwise_ref(xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor,
                       out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The torch reference of `linear_rowwise`: fp32 products of the same fp8 operands (exact), summed by torch."""
    return ((xq.float() @ wq.float().t()) * sx[:, None] * sw[None, :]).to(out_dtype)  # [M, N]


__all__ = ["default_config", "e4m3_rows", "linear_rowwise", "linear_rowwise_kernel", "linear_rowwise_ref",
           "quantize_rows", "quantize_rows_kernel", "quantize_rows_ref", "rowwise_weight", "smem_bytes",
           "store_e4m3_row", "unpack_rows"]
