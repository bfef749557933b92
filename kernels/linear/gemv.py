"""The one-row kernel of the decode linear (linear.py): one token's out = x @ W.T on the CUDA cores, fp32 throughout,
over fp8 32 x 32-block weights or plain (bf16, fp32) ones. linear.py runs it for a single token unless the config
keeps that token on the tensor cores (`gemv` False: batch-invariant configs). Its own module, so that linear.py's
source hash, which keys the tuned configs of `linear_kernel`, covers that kernel alone; its tiles are a heuristic
(linear.py's `gemv_config`), not tuned. `gemv_swiglu_kernel` runs the shared expert's gate and up projections for
one token in one launch and applies the clamped SwiGLU (swiglu.py's `swiglu_one_row`).

Split K needs no second launch: each program writes its partial to a workspace and takes a ticket
(kernels/tickets.py); the program holding the tile's last ticket sums the tile's partials in split order (the order
of linear.py's `splitk_reduce_kernel`, so the same bits whichever program finishes last).
"""

from __future__ import annotations

from kernels.lang import pdl_prologue, tl, triton
from kernels.moe.experts import _swiglu
from kernels.tickets import last_arrival


@triton.jit
def _row_sums(x_ptr, w_ptr, s_ptr, g, split, pid_n, N: tl.constexpr, K: tl.constexpr, SCALE_COLS: tl.constexpr,
              FP8: tl.constexpr, K_PER_SPLIT: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    """(rows, mask, sums [block_N]): sum over split `split`'s K range of W[g*N + n, k] * x[g*K + k] for the tile's
    rows, fp32 throughout: fp8 codes (`FP8`) summed per 32-column block, then times that block's scale; plain
    weights' products summed over the stage."""
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
        if FP8:
            part = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], [block_N, KB, 32]), axis=2)  # [block_N, KB]
            kb = (k_begin + k0) // 32 + tl.arange(0, KB)
            s = tl.load(s_ptr + (rows // 32)[:, None] * SCALE_COLS + kb[None, :],
                        mask=mask_n[:, None] & (kb < SCALE_COLS)[None, :], other=0.0)
            acc += tl.sum(part * s, axis=1)
        else:
            acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return rows, mask_n, acc


@triton.jit
def _split_sum(ws_ptr, rows, mask_n, stride, SPLIT_K: tl.constexpr, block_N: tl.constexpr):
    """The partials ws[s * stride + rows] summed in split order, as linear.py's `splitk_reduce_kernel` adds them (from
    zero): the same bits whichever program is last. Read from L2 (.cg), where the other programs' stores went."""
    total = tl.zeros([block_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(ws_ptr + s * stride + rows, mask=mask_n, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def gemv_kernel(x_ptr, w_ptr, s_ptr, ws_ptr, out_ptr, count_ptr, N: tl.constexpr, K: tl.constexpr,
                GROUPS: tl.constexpr, SCALE_COLS: tl.constexpr, FP8: tl.constexpr, SPLIT_K: tl.constexpr,
                K_PER_SPLIT: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    """out[g*N + n] = sum over k of W[g*N + n, k] * x[g*K + k] (fp8 codes and block scales where `FP8`, else plain
    weights; `s_ptr` unread). Split K: the split's partial goes to ws[split, g*N + n] and the tile's last program to
    finish writes out."""
    pdl_prologue()
    pid_n = tl.program_id(0)
    pid_z = tl.program_id(1)
    g = pid_z // SPLIT_K
    split = pid_z % SPLIT_K
    rows, mask_n, acc = _row_sums(x_ptr, w_ptr, s_ptr, g, split, pid_n, N, K, SCALE_COLS, FP8, K_PER_SPLIT,
                                  block_N, block_K)
    if SPLIT_K == 1:
        tl.store(out_ptr + rows, acc, mask=mask_n)
    else:
        tl.store(ws_ptr + split * (GROUPS * N) + rows, acc, mask=mask_n)
        tile = g * tl.num_programs(0) + pid_n
        if last_arrival(count_ptr, tile, SPLIT_K):
            tl.store(out_ptr + rows, _split_sum(ws_ptr, rows, mask_n, GROUPS * N, SPLIT_K, block_N), mask=mask_n)
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def gemv_swiglu_kernel(x_ptr, w1_ptr, s1_ptr, w3_ptr, s3_ptr, ws_ptr, out_ptr, count_ptr, N: tl.constexpr,
                       K: tl.constexpr, SCALE_COLS: tl.constexpr, FP8: tl.constexpr, SPLIT_K: tl.constexpr,
                       K_PER_SPLIT: tl.constexpr, LIMIT: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    """The shared expert's h = swiglu(x W1^T, x W3^T) for one token in one launch: grid (N tiles, 2 * SPLIT_K), the
    first SPLIT_K programs of a tile on W1 (gate), the others on W3 (up), each writing its partial to
    ws[part, split, n]; the tile's last program sums each part as `gemv_kernel` does (an unsplit part as it is) and
    applies kernels/moe/experts.py's `_swiglu`, as swiglu.py's kernel does: h's bits are those of the three launches
    it replaces."""
    pdl_prologue()
    pid_n = tl.program_id(0)
    pid_z = tl.program_id(1)
    split = pid_z % SPLIT_K
    if pid_z < SPLIT_K:
        rows, mask_n, acc = _row_sums(x_ptr, w1_ptr, s1_ptr, 0, split, pid_n, N, K, SCALE_COLS, FP8, K_PER_SPLIT,
                                      block_N, block_K)
    else:
        rows, mask_n, acc = _row_sums(x_ptr, w3_ptr, s3_ptr, 0, split, pid_n, N, K, SCALE_COLS, FP8, K_PER_SPLIT,
                                      block_N, block_K)
    tl.store(ws_ptr + pid_z * N + rows, acc, mask=mask_n)
    if last_arrival(count_ptr, pid_n, 2 * SPLIT_K):
        if SPLIT_K == 1:
            gate = tl.load(ws_ptr + rows, mask=mask_n, other=0.0, cache_modifier=".cg")
            up = tl.load(ws_ptr + N + rows, mask=mask_n, other=0.0, cache_modifier=".cg")
        else:
            gate = _split_sum(ws_ptr, rows, mask_n, N, SPLIT_K, block_N)
            up = _split_sum(ws_ptr + SPLIT_K * N, rows, mask_n, N, SPLIT_K, block_N)
        tl.store(out_ptr + rows, _swiglu(gate, up, 1.0, LIMIT), mask=mask_n)
        tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


__all__ = ["gemv_kernel", "gemv_swiglu_kernel"]
