"""Engram's table lookup: the n-gram hashes and the rows they name, in one launch.

`engram_hash_rows(ngrams, table, scale)` is `dsl.ops.engram.engram_hash_rows` (engram_hash, then engram_rows): for
each token's compressed ids ngrams [N, n] and each column c = (k - 2) * heads + head (k = 2..n), the row id
XOR_{i<k}(tok_i * m_i) mod prime_c + offset_c, then that table row as fp32 (fp8 codes times their per-32 scales).
One program per block of block_M tokens and one column: it hashes its tokens (n int64 loads a token), picks its
column's prime and offset from the constexpr constants, gathers block_M rows of d values and writes them. Torch runs
a dozen launches (the products, an XOR and a remainder per k, a concatenation, the offsets; a gather of the codes,
one of the scales, their expansion, the product) and writes the ids and the gathered codes between them; here the
ids stay in registers and each row is read once: memory-bound on the gathered rows and the fp32 output
(N * cols * (d + d / 8 + 4 * d) bytes for an fp8 table: codes, scales, output).

Bit for bit the reference, for any int64 ids: the products and the XOR wrap modulo 2^64 in both; Triton's `%` takes
the dividend's sign and torch's the divisor's (a prime, positive), so a negative remainder gains the prime (a hash
is negative only when an id lies outside the compressed vocabulary: the multipliers are bounded so that the product
of an id inside it never overflows); the dequantised value is one fp32 product, as the reference's. Rows never
meet, so every config gives the same bits.
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch

TABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


@triton.jit(do_not_specialize=["n_rows"])
def engram_hash_rows_kernel(ngrams_ptr, table_ptr, scale_ptr, out_ptr, n_rows, NGRAM: tl.constexpr,
                            HEADS: tl.constexpr, MULTIPLIERS: tl.constexpr, PRIMES: tl.constexpr,
                            OFFSETS: tl.constexpr, D: tl.constexpr, SCALED: tl.constexpr, block_M: tl.constexpr,
                            block_D: tl.constexpr):
    pdl_prologue()
    COLS: tl.constexpr = len(PRIMES)
    SCALE_COLS: tl.constexpr = (D + 31) // 32
    rows = tl.program_id(0).to(tl.int64) * block_M + tl.arange(0, block_M)
    col = tl.program_id(1)
    in_rows = rows < n_rows
    prime = tl.full([], 1, tl.int64)
    offset = tl.full([], 0, tl.int64)
    for j in tl.static_range(COLS):
        prime = tl.where(col == j, PRIMES[j], prime)
        offset = tl.where(col == j, OFFSETS[j], offset)
    last = col // HEADS + 1  # the column's k-gram: tokens 0..last
    rolling = tl.load(ngrams_ptr + rows * NGRAM, mask=in_rows, other=0) * MULTIPLIERS[0]
    for i in tl.static_range(1, NGRAM):
        tok = tl.load(ngrams_ptr + rows * NGRAM + i, mask=in_rows, other=0)
        rolling = tl.where(i <= last, rolling ^ (tok * MULTIPLIERS[i]), rolling)
    ids = rolling % prime
    ids = tl.where(ids < 0, ids + prime, ids) + offset  # [block_M]: torch's remainder, non-negative
    d = tl.arange(0, block_D)
    mask = in_rows[:, None] & (d < D)[None, :]
    values = tl.load(table_ptr + ids[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        values = values * tl.load(scale_ptr + ids[:, None] * SCALE_COLS + (d // 32)[None, :], mask=mask, other=1.0)
    tl.store(out_ptr + (rows[:, None] * COLS + col) * D + d[None, :], values, mask=mask)


def default_config(m: int, d: int) -> dict:
    """Decode: a token a program (its columns spread over the SMs); past 64 tokens, about 2048 values a program.
    Warps for 4 values a thread or more (16-byte stores of the fp32 rows)."""
    block_d = triton.next_power_of_2(d)
    block_m = 1 if m <= 64 else max(1, 2048 // block_d)
    return {"block_M": block_m, "num_warps": max(1, min(4, block_m * block_d // 128))}


def _check_constants(n: int, multipliers: tuple, primes: tuple, offsets: tuple) -> int:
    """The number of heads, after checking the constants' lengths and signs."""
    heads = len(primes[0]) if primes else 0
    if n < 2 or len(multipliers) != n or len(primes) != n - 1 or heads == 0 or any(len(p) != heads for p in primes):
        raise ValueError(f"engram_hash_rows needs n >= 2 multipliers and n - 1 rows of heads primes for n-grams of "
                         f"{n} ids, got {len(multipliers)} multipliers and primes {[len(p) for p in primes]}")
    if len(offsets) != (n - 1) * heads:
        raise ValueError(f"engram_hash_rows' offsets need one per column, {(n - 1) * heads}, got {len(offsets)}")
    if any(p <= 0 for row in primes for p in row) or any(o < 0 for o in offsets):
        raise ValueError("engram_hash_rows' primes must be positive and its offsets non-negative")
    return heads


def engram_hash_rows(ngrams: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None, *,
                     multipliers: tuple[int, ...], primes: tuple[tuple[int, ...], ...], offsets: tuple[int, ...],
                     config: dict | None = None) -> torch.Tensor:
    """ngrams [N, n] int64 (each token's compressed ids, newest first), table [R, d] float32/bfloat16/float16 or
    float8_e4m3fn with scale [R, ceil(d / 32)] float32 (one per 32 values of a row; an fp8 table without one gives
    its codes): returns the rows fp32 [N, (n - 1) * heads, d], column (k - 2) * heads + head for k = 2..n."""
    if ngrams.dim() != 2 or ngrams.dtype != torch.int64 or not ngrams.is_contiguous():
        raise ValueError(f"engram_hash_rows' ngrams must be contiguous int64 [N, n], got {ngrams.dtype} "
                         f"{list(ngrams.shape)}")
    n_rows, n = ngrams.shape
    heads = _check_constants(n, multipliers, primes, offsets)
    if table.dim() != 2 or table.dtype not in TABLE_DTYPES or not table.is_contiguous():
        raise ValueError(f"engram_hash_rows' table must be contiguous 2-D float32, bfloat16, float16 or "
                         f"float8_e4m3fn, got {table.dtype} {list(table.shape)}")
    r, d = table.shape
    reach = max(o + p for o, p in zip(offsets, (p for row in primes for p in row), strict=True))
    if r < reach:
        raise ValueError(f"engram_hash_rows' table has {r} rows; the hash reaches row {reach - 1}")
    scaled = scale is not None
    if scaled and (table.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or not scale.is_contiguous()
                   or tuple(scale.shape) != (r, -(-d // 32))):
        raise ValueError(f"engram_hash_rows' scale goes with an fp8 table: contiguous float32 [{r}, {-(-d // 32)}], "
                         f"got {scale.dtype} {list(scale.shape)} for a {table.dtype} table")
    cols = (n - 1) * heads
    out = torch.empty(n_rows, cols, d, dtype=torch.float32, device=ngrams.device)
    if n_rows == 0:
        return out
    config = config or default_config(n_rows, d)
    flat_primes = tuple(int(p) for row in primes for p in row)
    launch(engram_hash_rows_kernel, (triton.cdiv(n_rows, config["block_M"]), cols),
           (ngrams, table, scale if scaled else table, out, n_rows),
           dict(NGRAM=n, HEADS=heads, MULTIPLIERS=tuple(int(m) for m in multipliers), PRIMES=flat_primes,
                OFFSETS=tuple(int(o) for o in offsets), D=d, SCALED=scaled, block_M=config["block_M"],
                block_D=triton.next_power_of_2(d)),
           config["num_warps"], 1)
    return out


__all__ = ["default_config", "engram_hash_rows", "engram_hash_rows_kernel"]
