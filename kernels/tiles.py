"""What the GEMMs that cover a whole [M, N] output with one program per tile share (kernels/linear/fp8.py,
kernels/linear/prefill.py): the grouped tile order, and a tile's product over K of two K-contiguous operands."""

from __future__ import annotations

from kernels.lang import tl, triton


@triton.jit
def grouped_tile(M, N: tl.constexpr, block_M: tl.constexpr, block_N: tl.constexpr, group_M: tl.constexpr):
    """This program's output tile in grouped order, (offs_m [block_M], offs_n [block_N]): `group_M` row tiles sweep
    every column tile together, so a group's W tiles stay in L2 while its rows pass over them."""
    pid = tl.program_id(0)
    tiles_n: tl.constexpr = (N + block_N - 1) // block_N
    first_m = (pid // (group_M * tiles_n)) * group_M
    size_m = tl.minimum(tl.cdiv(M, block_M) - first_m, group_M)
    pid_m = first_m + (pid % (group_M * tiles_n)) % size_m
    pid_n = (pid % (group_M * tiles_n)) // size_m
    return pid_m * block_M + tl.arange(0, block_M), pid_n * block_N + tl.arange(0, block_N)



@triton.jit
def tile_dot(a_ptr, b_ptr, offs_m, offs_n, M, N: tl.constexpr, K: tl.constexpr, stride_A: tl.constexpr,
             block_M: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr, promote_K: tl.constexpr):
    """fp32 [block_M, block_N] = A[rows] @ B[cols]^T over all of K, for A [M, K] (rows `stride_A` apart) and B [N, K]
    both K-contiguous (the tensor cores' layout), in block_K steps. Rows and columns past the ends read valid ones
    (m % M, n % N): the caller's store drops them. promote_K > 0 (fp8): the partial sums go to the fp32 accumulator
    every promote_K."""
    offs_k = tl.arange(0, block_K)
    a_ptrs = a_ptr + (offs_m % M)[:, None].to(tl.int64) * stride_A + offs_k[None, :]  # [block_M, block_K]
    b_ptrs = b_ptr + (offs_n % N)[:, None].to(tl.int64) * K + offs_k[None, :]  # [block_N, block_K]
    acc = tl.zeros([block_M, block_N], dtype=tl.float32)
    for k0 in range(0, K, block_K):
        if K % block_K == 0:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
        if promote_K > 0:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=promote_K)
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += block_K
        b_ptrs += block_K
    return acc


__all__ = ["grouped_tile", "tile_dot"]
