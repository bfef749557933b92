"""RMSNorm over the last dim in TileLang: `block_M` rows a block, each row's values spread over `threads / block_M`
threads in registers (padded to `block_D`, a multiple of them), fp32 throughout; one read of x, one write of y.

The op is `dsl.ops.dense.rms_norm` (fp32 out), as in kernels/norm/rms_norm.py, which serves it where TileLang cannot
build (kernels/norm/lowering.py). A row's sum runs in a fixed order (each thread's values, then across the row's
threads) whatever the other rows are: every config is batch-invariant.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations (shapes, dtypes) as values.
import torch

from dsl.ops.dense import rms_norm as reference
from kernels.launch import launch
from kernels.tilelang_kernel import TileLangKernel, row_tiles


def rms_norm_tilelang(dtypes: dict[str, str], threads: int, *, D: int, EPS: float, HAS_W: bool, block_M: int,
                      block_D: int):
    """X [m, D] fp32/bf16, W [D] fp32 (unread without HAS_W), Y [m, D] fp32; m rows, a dynamic symbol."""
    import tilelang.language as T

    m = T.dynamic("m")

    @T.prim_func
    def rms_norm_tilelang(X: T.Tensor((m, D), dtypes["X"]), W: T.Tensor((D,), dtypes["W"]),
                          Y: T.Tensor((m, D), "float32")):
        with T.Kernel(T.ceildiv(m, block_M), threads=threads) as bx:
            T.pdl_sync()  # kernels.lang.pdl_prologue: wait for the kernels before, then let the next launch
            T.pdl_trigger()
            x = T.alloc_fragment((block_M, block_D), "float32")
            sq = T.alloc_fragment((block_M, block_D), "float32")
            scale = T.alloc_fragment((block_M,), "float32")
            T.copy(X[bx * block_M:(bx + 1) * block_M, 0:block_D], x)  # rows past m, columns past D: 0 (predicated)
            for i, j in T.Parallel(block_M, block_D):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, scale, dim=1)
            for i in T.Parallel(block_M):
                scale[i] = T.rsqrt(scale[i] / D + EPS)
            if HAS_W:
                for i, j in T.Parallel(block_M, block_D):
                    x[i, j] = x[i, j] * scale[i] * T.if_then_else(j < D, W[j], 0.0)  # no test when D == block_D
            else:
                for i, j in T.Parallel(block_M, block_D):
                    x[i, j] = x[i, j] * scale[i]
            T.copy(x, Y[bx * block_M:(bx + 1) * block_M, 0:block_D])

    return rms_norm_tilelang


def _emulate(X: torch.Tensor, W: torch.Tensor, Y: torch.Tensor, m: int, *, EPS: float, HAS_W: bool, **tiles) -> None:
    Y.copy_(reference(X, W if HAS_W else None, eps=EPS))


rms_norm_kernel = TileLangKernel(rms_norm_tilelang, _emulate, ("X", "W", "Y", "m"))


def default_config(d: int) -> dict:
    """Threads a row: the power of two in [32, 256] that leaves each 8 values or more (at least 32); 128-thread
    blocks of several rows where a row needs fewer."""
    per_row = 32
    while per_row < 256 and 2 * per_row * 8 <= d:
        per_row *= 2
    block_m = max(1, 128 // per_row)
    return {"block_M": block_m, "threads": block_m * per_row}


def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float, config: dict | None = None) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim: x [..., D] float32/bfloat16 contiguous, w [D] float32 or
    None. Returns fp32 [..., D]. `config`: {"block_M": rows a block, "threads": a multiple of 32 and of block_M}."""
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"rms_norm needs contiguous float32/bfloat16 x, got {x.dtype}")
    d = x.shape[-1]
    if w is not None and (tuple(w.shape) != (d,) or w.dtype != torch.float32 or not w.is_contiguous()
                          or w.device != x.device):
        raise ValueError(f"rms_norm weight must be contiguous float32 [{d}] on {x.device}, got {w.dtype} "
                         f"{list(w.shape)}")
    config = config or default_config(d)
    block_m, threads = row_tiles(config, "rms_norm")
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = x.numel() // d if d else 0
    if rows == 0:
        return out
    per_row = threads // block_m
    block_d = -(-d // per_row) * per_row
    launch(rms_norm_kernel, (-(-rows // block_m),), (x, x if w is None else w, out, rows),
           {"D": d, "EPS": eps, "HAS_W": w is not None, "block_M": block_m, "block_D": block_d}, threads // 32, 1)
    return out


__all__ = ["default_config", "rms_norm", "rms_norm_kernel"]
