"""The one-row kernel of the decode linear (linear.py): one token's out = x @ W.T over fp8 32 x 32-block weights on
the CUDA cores, fp32 throughout. linear.py runs it for a single token unless the config keeps that token on the
tensor cores (`gemv` False: batch-invariant configs). Its own module, so that linear.py's source hash, which keys
the tuned configs of `linear_kernel`, covers that kernel alone; its tiles are a heuristic (linear.py's
`gemv_config`), not tuned.
"""

from __future__ import annotations

from kernels.lang import tl, triton


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr,
                SCALE_COLS: tl.constexpr, SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, block_N: tl.constexpr,
                block_K: tl.constexpr):
    """out[g*N + n] (+ split * G*N, a partial) = sum over the split's K range of W[g*N + n, k] * x[g*K + k]: fp8 codes
    to fp32, summed per 32-column block, then times that block's scale; fp32 throughout."""
    pid_n = tl.program_id(0)
    pid_z = tl.program_id(1)
    g = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    offs_n = pid_n * block_N + tl.arange(0, block_N)
    rows = g * N + offs_n
    mask_n = offs_n < N
    KB: tl.constexpr = block_K // 32
    acc = tl.zeros([block_N], dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    for k0 in range(0, K_PER_SPLIT, block_K):
        ks = k_begin + k0 + tl.arange(0, block_K)
        mask_k = ks < K
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                    other=0.0)
        x = tl.load(x_ptr + g * K + ks, mask=mask_k, other=0.0).to(tl.float32)
        part = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], [block_N, KB, 32]), axis=2)  # [block_N, KB]
        kb = (k_begin + k0) // 32 + tl.arange(0, KB)
        s = tl.load(s_ptr + (rows // 32)[:, None] * SCALE_COLS + kb[None, :],
                    mask=mask_n[:, None] & (kb < SCALE_COLS)[None, :], other=0.0)
        acc += tl.sum(part * s, axis=1)
    tl.store(out_ptr + split * (GROUPS * N) + rows, acc, mask=mask_n)


__all__ = ["gemv_kernel"]
