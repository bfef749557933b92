"""The hyper-connections' collapse fused with the RMSNorm after it, in TileLang: each token's hc streams summed with
its `pre` weights in registers, then normalised; one read of the streams, one write of the output.

The op is `dsl.ops.hyper.hc_collapse_rms_norm` (made by the fusion pass), as in kernels/hyper/hyper.py, which serves
it where TileLang cannot build (kernels/hyper/lowering.py). Rows are laid out as in kernels/norm/rms_norm_tilelang.py
(same configs); a row's sum runs in a fixed order whatever the other rows are: every config is batch-invariant.
"""

# No `from __future__ import annotations` here: TileLang evaluates a kernel's annotations (shapes, dtypes) as values.
import torch

from dsl.ops.hyper import hc_collapse_rms_norm as reference
from kernels.launch import launch
from kernels.norm.rms_norm_tilelang import default_config
from kernels.tilelang_kernel import TileLangKernel, row_tiles


def hc_collapse_rms_norm_tilelang(dtypes: dict[str, str], threads: int, *, HC: int, D: int, EPS: float,
                                  block_M: int, block_D: int):
    """H [n, HC, D] fp32 streams, Pre [n, HC] fp32, W [D] fp32, Y [n, D] fp32; n tokens, a dynamic symbol."""
    import tilelang.language as T

    n = T.dynamic("n")

    @T.prim_func
    def hc_collapse_rms_norm_tilelang(H: T.Tensor((n, HC, D), "float32"), Pre: T.Tensor((n, HC), "float32"),
                                      W: T.Tensor((D,), "float32"), Y: T.Tensor((n, D), "float32")):
        with T.Kernel(T.ceildiv(n, block_M), threads=threads) as bx:
            T.pdl_sync()  # kernels.lang.pdl_prologue: wait for the kernels before, then let the next launch
            T.pdl_trigger()
            pre = T.alloc_fragment((block_M, HC), "float32")
            h = T.alloc_fragment((block_M, block_D), "float32")
            x = T.alloc_fragment((block_M, block_D), "float32")
            sq = T.alloc_fragment((block_M, block_D), "float32")
            scale = T.alloc_fragment((block_M,), "float32")
            rows = slice(bx * block_M, (bx + 1) * block_M)
            T.copy(Pre[rows, 0:HC], pre)
            T.clear(x)
            for k in T.unroll(HC):  # streams in order, as the reference sums them
                T.copy(H[rows, k, 0:block_D], h)  # rows past n, columns past D: 0 (predicated)
                for i, j in T.Parallel(block_M, block_D):
                    x[i, j] += pre[i, k] * h[i, j]
            for i, j in T.Parallel(block_M, block_D):
                sq[i, j] = x[i, j] * x[i, j]
            T.reduce_sum(sq, scale, dim=1)
            for i in T.Parallel(block_M):
                scale[i] = T.rsqrt(scale[i] / D + EPS)
            for i, j in T.Parallel(block_M, block_D):
                x[i, j] = x[i, j] * scale[i] * T.if_then_else(j < D, W[j], 0.0)  # no test when D == block_D
            T.copy(x, Y[rows, 0:block_D])

    return hc_collapse_rms_norm_tilelang


def _emulate(H: torch.Tensor, Pre: torch.Tensor, W: torch.Tensor, Y: torch.Tensor, n: int, *, EPS: float,
             **shapes) -> None:
    Y.copy_(reference(H, Pre, W, eps=EPS))


hc_collapse_rms_norm_kernel = TileLangKernel(hc_collapse_rms_norm_tilelang, _emulate, ("H", "Pre", "W", "Y", "n"))


def hc_collapse_rms_norm(h: torch.Tensor, pre: torch.Tensor, w: torch.Tensor, *, eps: float,
                         config: dict | None = None) -> torch.Tensor:
    """sum_k pre[:, k] * h[:, k], then w * x * rsqrt(mean(x^2) + eps): h [N, hc, D], pre [N, hc], w [D], all fp32
    contiguous. Returns fp32 [N, D]. `config` as kernels/norm/rms_norm_tilelang.py's (rows a block, threads)."""
    if h.dim() != 3 or h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"hc_collapse needs contiguous float32 streams [N, hc, D], got {h.dtype} {list(h.shape)}")
    n, hc, d = h.shape
    for t, shape in ((pre, (n, hc)), (w, (d,))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous() or t.device != h.device:
            raise ValueError(f"hc_collapse_rms_norm needs contiguous float32 {list(shape)} on {h.device}, got "
                             f"{t.dtype} {list(t.shape)}")
    config = config or default_config(d)
    block_m, threads = row_tiles(config, "hc_collapse_rms_norm")
    out = torch.empty(n, d, dtype=torch.float32, device=h.device)
    if n == 0:
        return out
    per_row = threads // block_m
    block_d = -(-d // per_row) * per_row
    launch(hc_collapse_rms_norm_kernel, (-(-n // block_m),), (h, pre, w, out, n),
           {"HC": hc, "D": d, "EPS": eps, "block_M": block_m, "block_D": block_d}, threads // 32, 1)
    return out


__all__ = ["hc_collapse_rms_norm", "hc_collapse_rms_norm_kernel"]
