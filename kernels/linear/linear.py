"""Linear for decode shapes (1 to 64 tokens) and beyond: out = x @ W.T over bf16/fp32 or fp8 32x32-block weights.

The weight is the large operand, so a program owns `block_N` output features and streams their rows of W once;
the few tokens ride along as the narrow side of the product (out^T = W x^T, "swap AB"). fp8 weights are converted
to bf16 in registers; their power-of-two block scales multiply the activations instead (exact): a tile of
`block_N` rows (a multiple of 32) is multiplied as block_N/32 batched products, one per 32-row scale block. For
many tokens (`fp8_dequant_w`) the scales multiply W in registers instead and the product is one 2-D dot.
When there are too few output tiles to fill the GPU, K is split into `split_k` fixed ranges written to a
workspace and summed in a fixed order by a second kernel, so the result does not depend on the batch.
`groups` runs a block-diagonal linear (wo_a): group g maps x[:, g*K:(g+1)*K] through rows g*N..(g+1)*N-1 of W.

One token (a batch-1 decode step) runs gemv.py's `gemv_kernel` instead: no tensor cores, whose smallest tile would
pad the token to 16 rows (and convert every fp8 code to bf16 on the way), and no second launch for split K. Each
weight goes to fp32 and meets the token's fp32 activation in one multiply-add; an fp8 32 x 32 block's partial sum
takes its scale once; nothing is rounded to bf16 (so its sums are closer to the fp32 reference's than the tensor
cores', with other bits), and `dot_fp32`'s fp32 products are what it computes anyway for plain weights. Its tiles
follow the weight's shape alone (`gemv_config`). Configs with `gemv` False keep one token on the tensor cores: the
batch-invariant ones (kernels/linear/lowering.py), where a row's bits may not depend on how many rows there are.
"""

from __future__ import annotations

import torch

# tickets and gemv come in as modules: this module's source hash, the tuned configs' key, covers every kernel in its
# namespace, imported ones included
from kernels import tickets
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.linear import gemv

SCALE_BLOCK = 32


@triton.jit(do_not_specialize=["M"])
def linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M,
                  N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, SCALE_COLS: tl.constexpr,
                  FP8: tl.constexpr, FP8_DEQ_W: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT_K: tl.constexpr,
                  K_PER_SPLIT: tl.constexpr,
                  block_M: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    pdl_prologue()
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_z = tl.program_id(2)
    g = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    offs_n = pid_n * block_N + tl.arange(0, block_N)
    offs_m = pid_m * block_M + tl.arange(0, block_M)
    offs_k = tl.arange(0, block_K)
    rows = g * N + offs_n  # rows of W
    mask_n = offs_n < N
    mask_m = offs_m < M
    R: tl.constexpr = max(block_N // 32, 1)  # fp8: the tile's 32-row scale blocks
    srows = (g * N + pid_n * block_N) // 32 + tl.arange(0, R)
    if FP8 and not FP8_DEQ_W:
        acc = tl.zeros([R, 32, block_M], dtype=tl.float32)  # out^T tile, by scale block
    else:
        acc = tl.zeros([block_N, block_M], dtype=tl.float32)  # out^T tile
    k_begin = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, block_K):
        ks = k_begin + k0 + offs_k
        mask_k = ks < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0)  # [block_N, block_K]
        x = tl.load(x_ptr + offs_m[None, :].to(tl.int64) * (GROUPS * K) + (g * K + ks)[:, None],
                    mask=mask_m[None, :] & mask_k[:, None], other=0.0).to(tl.float32)  # [block_K, block_M]
        if FP8 and FP8_DEQ_W:
            # many tokens: scale W itself (one multiply per weight) so the product is one 2-D tensor-core dot
            s = tl.load(s_ptr + srows[:, None] * SCALE_COLS + (ks // 32)[None, :],
                        mask=(srows[:, None] * 32 < (g + 1) * N) & mask_k[None, :], other=0.0)  # [R, block_K]
            sw = tl.reshape(tl.broadcast_to(s[:, None, :], [R, 32, block_K]), [block_N, block_K])
            if DOT_FP32:
                acc = tl.dot(w.to(tl.float32) * sw, x, acc, input_precision="ieee")
            else:
                acc = tl.dot((w.to(tl.float32) * sw).to(tl.bfloat16), x.to(tl.bfloat16), acc)
        elif FP8:
            # each 32-row block of the tile has its own row of block scales: scale a copy of x per block (a power
            # of two, so exact) and multiply block by block, leaving W's codes to convert straight to bf16
            s = tl.load(s_ptr + srows[:, None] * SCALE_COLS + (ks // 32)[None, :],
                        mask=(srows[:, None] * 32 < (g + 1) * N) & mask_k[None, :], other=0.0)  # [R, block_K]
            xs = x[None, :, :] * s[:, :, None]  # [R, block_K, block_M]
            w3 = tl.reshape(w, [R, 32, block_K])
            if DOT_FP32:
                acc = tl.dot(w3.to(tl.float32), xs, acc, input_precision="ieee")
            else:
                acc = tl.dot(w3.to(tl.bfloat16), xs.to(tl.bfloat16), acc)
        elif DOT_FP32:
            acc = tl.dot(w.to(tl.float32), x, acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(tl.bfloat16), x.to(tl.bfloat16), acc)
    if FP8 and not FP8_DEQ_W:
        acc = tl.reshape(acc, [block_N, block_M])
    out = out_ptr + split * M * (GROUPS * N)
    tl.store(out + offs_m[None, :] * (GROUPS * N) + rows[:, None], acc, mask=mask_n[:, None] & mask_m[None, :])


@triton.jit(do_not_specialize=["total"])
def splitk_reduce_kernel(ws_ptr, out_ptr, total, SPLIT_K: tl.constexpr, block: tl.constexpr):
    pdl_prologue()
    offs = tl.program_id(0) * block + tl.arange(0, block)
    mask = offs < total
    acc = tl.zeros([block], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on timing or batch
        acc += tl.load(ws_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc, mask=mask)


SMEM_BUDGET = 200 * 1024  # of the 227 KB a block may use on sm_90 / sm_100


def default_config(m: int, n: int, k: int, groups: int = 1, fp8: bool = False, num_sms: int = 132,
                   x_bytes: int = 4, w_bytes: int = 2) -> dict:
    """The heuristic tile for a token count `m` (a bucket's upper end) and a weight of `groups` x [n, k].

    Decode (m <= 64): 64 output rows per program, K streamed in 256-wide stages, split-K until
    there are two programs per SM. Larger m: 64 x 128 tiles. The pipelined W and x tiles fit `SMEM_BUDGET`.
    """
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n = 64 if m <= 64 else 128
    block_k = (128 if fp8 else 256) if m <= 64 else 64  # fp8 at 256 spills: one x copy per scale block
    stages = 3 if m <= 64 else 4
    w_bytes = 1 if fp8 else w_bytes
    while stages * block_k * (block_n * w_bytes + block_m * x_bytes) > SMEM_BUDGET and block_k > 64:
        block_k //= 2
    while stages * block_k * (block_n * w_bytes + block_m * x_bytes) > SMEM_BUDGET and stages > 2:
        stages -= 1
    split = split_k(triton.cdiv(n, block_n) * groups * triton.cdiv(m, block_m), k, block_k, num_sms)
    warps = 8 if fp8 and block_m >= 32 else 4  # fp8 keeps a scaled copy of x per scale block: spread it
    config = {"block_M": block_m, "block_N": block_n, "block_K": block_k, "split_k": split,
              "num_warps": warps, "num_stages": stages}
    if fp8 and m > 16:
        config["fp8_dequant_w"] = True  # W scaled in registers, one 2-D product: past 16 tokens, faster than x copies
    return config


def split_k(tiles: int, k: int, block_k: int, num_sms: int = 132) -> int:
    """K splits (a power of two) for `tiles` output tiles: doubled until there are two programs per SM, while each
    split keeps two stages of `block_k` or more."""
    split = 1
    while tiles * split < 2 * num_sms and k // (split * 2) >= 2 * block_k:
        split *= 2
    return split


def k_per_split(k: int, split: int, block_k: int) -> int:
    """The K range one of `split` splits covers: whole stages of `block_k`."""
    return triton.cdiv(triton.cdiv(k, split), block_k) * block_k


def gemv_config(n: int, k: int, groups: int = 1, num_sms: int = 132, w_bytes: int = 1) -> dict:
    """gemv.py's `gemv_kernel` tiles for a weight of `groups` x [n, k] of `w_bytes` a value: 64 rows by 256 fp8
    columns a stage (the H100 sweep of bench/RESULTS.md's fp8 decode linear section) or 128 plain (bf16, fp32) ones,
    K split by `split_k`. The plain width is bench/RESULTS.md's (one-row kernel section): 128 bf16 columns against
    256 at the compressors' shape, 128 fp32 columns against 64 at the router's, each as its ratio to the tensor
    cores in its own call."""
    block_k = 256 if w_bytes == 1 else 128
    return {"block_N": 64, "block_K": block_k, "split_k": split_k(triton.cdiv(n, 64) * groups, k, block_k, num_sms),
            "num_warps": 4, "num_stages": 3}


def check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, groups: int, config: dict) -> None:
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"linear needs x [M, G*K] and w [G*N, K], got {list(x.shape)} and {list(w.shape)}")
    if w.shape[0] % groups or x.shape[1] != groups * w.shape[1]:
        raise ValueError(f"x {list(x.shape)} and w {list(w.shape)} do not make {groups} groups")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("linear needs contiguous x and w")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, w on {w.device}")
    if w.dtype == torch.float8_e4m3fn:
        n, k = w.shape
        want = (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, SCALE_BLOCK))
        if scale is None or tuple(scale.shape) != want or scale.dtype != torch.float32 or not scale.is_contiguous():
            raise ValueError(f"an fp8 weight {list(w.shape)} needs contiguous float32 block scales {list(want)}")
        if groups > 1 and (n // groups) % SCALE_BLOCK:
            raise ValueError(f"fp8 groups need a multiple of 32 rows per group, got {n // groups}")
        if config["block_N"] % SCALE_BLOCK or config["block_K"] % SCALE_BLOCK:
            raise ValueError(f"fp8 tiles are multiples of 32 rows and columns, got {config}")
    elif w.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"w must be bfloat16, float32 or float8_e4m3fn, got {w.dtype}")
    elif scale is not None:
        raise ValueError("a plain weight takes no scale")


def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *, groups: int = 1,
           config: dict | None = None, dot_fp32: bool = False) -> torch.Tensor:
    """out [M, G*N] fp32 = x [M, G*K] @ W.T, per group g through rows g*N..(g+1)*N-1 of W [G*N, K].

    x: float32 or bfloat16, contiguous. W: bfloat16 / float32, or float8_e4m3fn with `scale` float32
    [ceil(G*N/32), ceil(K/32)] (one power-of-two scale per 32 x 32 block). Accumulates in fp32; operands are
    rounded to bf16 unless `dot_fp32` (fp32 products, for exactness checks). One token runs `gemv_kernel` (fp32
    throughout) unless the config's `gemv` is False, or `dot_fp32` over fp8 weights.
    """
    m = x.shape[0] if x.dim() == 2 else 0
    n, k = w.shape[0] // groups, w.shape[1]
    config = config or default_config(max(m, 1), n, k, groups, w.dtype == torch.float8_e4m3fn,
                                      w_bytes=w.element_size())
    check(x, w, scale, groups, config)
    out = torch.empty(m, groups * n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    fp8 = w.dtype == torch.float8_e4m3fn
    if on_one_row(m, w, config, dot_fp32):
        return _gemv(x, w, scale, groups, out)
    split, block_k = config["split_k"], config["block_K"]
    ws = out if split == 1 else torch.empty(split, m, groups * n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config["block_N"]), triton.cdiv(m, config["block_M"]), groups * split)
    launch(linear_kernel, grid, (x, w, scale if fp8 else w, ws, m),
           dict(N=n, K=k, GROUPS=groups, SCALE_COLS=scale.shape[1] if fp8 else 0, FP8=fp8,
                FP8_DEQ_W=fp8 and config.get("fp8_dequant_w", False), DOT_FP32=dot_fp32,
                SPLIT_K=split, K_PER_SPLIT=k_per_split(k, split, block_k), block_M=config["block_M"],
                block_N=config["block_N"], block_K=block_k),
           config["num_warps"], config["num_stages"])
    return _sum_splits(ws, out, split)


def on_one_row(m: int, w: torch.Tensor, config: dict, dot_fp32: bool) -> bool:
    """Whether `linear` runs `m` tokens over `w` with `config` on gemv.py's one-row kernels: one token, unless the
    config keeps it on the tensor cores (`gemv` False) or fp8 weights are multiplied in fp32 (`dot_fp32`, which the
    one-row kernel gives plain weights anyway)."""
    fp8 = w.dtype == torch.float8_e4m3fn
    return m == 1 and config.get("gemv", True) and not (fp8 and dot_fp32)


def _gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, groups: int,
          out: torch.Tensor) -> torch.Tensor:
    """One token's out [1, G*N] on `gemv_kernel`, one launch: its K splits sum inside it."""
    n, k = w.shape[0] // groups, w.shape[1]
    fp8 = w.dtype == torch.float8_e4m3fn
    config = gemv_config(n, k, groups, w_bytes=w.element_size())
    split, block_k, block_n = config["split_k"], config["block_K"], config["block_N"]
    ws = out if split == 1 else torch.empty(split, groups * n, dtype=torch.float32, device=x.device)
    launch(gemv.gemv_kernel, (triton.cdiv(n, block_n), groups * split),
           (x, w, scale if fp8 else w, ws, out,
            tickets.tile_counters(x.device, groups * triton.cdiv(n, block_n) if split > 1 else 0)),
           dict(N=n, K=k, GROUPS=groups, SCALE_COLS=scale.shape[1] if fp8 else 0, FP8=fp8, SPLIT_K=split,
                K_PER_SPLIT=k_per_split(k, split, block_k), block_N=block_n, block_K=block_k),
           config["num_warps"], config["num_stages"])
    return out


def _sum_splits(ws: torch.Tensor, out: torch.Tensor, split: int) -> torch.Tensor:
    """`out` = the `split` partials of `ws` summed in split order (`splitk_reduce_kernel`); `ws` is `out` unsplit."""
    if split > 1:
        total = out.numel()
        launch(splitk_reduce_kernel, (triton.cdiv(total, 1024),), (ws, out, total), dict(SPLIT_K=split, block=1024))
    return out


__all__ = ["check", "default_config", "gemv_config", "k_per_split", "linear", "linear_kernel", "on_one_row",
           "split_k", "splitk_reduce_kernel"]
