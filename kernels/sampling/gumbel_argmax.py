"""Sampling's draw (deepinfer/sampler.py `sample_plain`) in two launches: for each row of logits, the argmax of
logits * (1 / T) plus its hashed Gumbel noise over the tokens above -inf, or the plain argmax for a greedy row.

The noise of token v in a row seeded s at position p is -log(-log(u)), u = ((h >>> 11) + 0.5) * 2^-53 with
h = mix64(mix64(mix64(s) + p) + v), splitmix64's mixer in wrapping int64 arithmetic (`>>>`, uint64's logical shift,
is the arithmetic shift with the copied sign bits masked off), all in float64 as the torch code: the logit widened
exactly, the product by the row's factor 1 / T rounded once (`fma(x, factor, 0)`: no multiply-add may fuse it with
the sum that follows), the logs libdevice's on the GPU as torch's CUDA log.

Each value becomes an int64 key whose order is torch.argmax's: a float's bits with the magnitude bits of negatives
flipped (-0 taken as +0), a NaN above everything (torch.argmax picks the first NaN). A sampled row's masked tokens
(scaled value -inf or NaN) sit below every allowed one, the NaNs above the -infs, so a row with nothing allowed
picks the argmax of its scaled logits as the sampler falls back to. `gumbel_argmax_kernel` reduces block_V
consecutive tokens of a row to (largest key, lowest token with it); `argmax_partials_kernel` reduces a row's blocks
in token order. No sum, no order that depends on the batch: a row's token is the same in any batch.

Rows with penalties, a min_p / top_k / top_p cut or log-probabilities stay with `sample` in torch: min_p's and top_p's
cuts compare float64 softmax probabilities (and top_p their cumulative sum) whose bits follow torch's reduction order.
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch

KERNEL_NAMES = ("gumbel_argmax_kernel", "argmax_partials_kernel")


@triton.jit
def _mix64(x):
    """splitmix64's step on int64 viewed as uint64: its constants 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9 and
    0x94D049BB133111EB as int64, x >>> n written (x >> n) & (2^(64 - n) - 1)."""
    z = x + -7046029254386353131
    z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * -4658895280553007687
    z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685
    return z ^ ((z >> 31) & 0x1FFFFFFFF)


@triton.jit
def _gumbel(key, ids):
    """Gumbel noise (float64) of tokens `ids` (int64) in the row whose key is mix64(mix64(seed) + position)."""
    h = _mix64(key + ids)
    u = (((h >> 11) & 0x1FFFFFFFFFFFFF).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53
    return -tl.log(-tl.log(u))


@triton.jit
def _order(x):
    """int64 keys ordered as the float64 values x (-0 as +0; no NaN here)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int64, bitcast=True)
    return bits ^ ((bits >> 63) & 0x7FFFFFFFFFFFFFFF)


@triton.jit
def gumbel_argmax_kernel(logits_ptr, factors_ptr, seeds_ptr, positions_ptr, keys_ptr, ids_ptr, row_stride,
                         V: tl.constexpr, block_V: tl.constexpr):
    pdl_prologue()
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    ids = b * block_V + tl.arange(0, block_V)  # [block_V]
    valid = ids < V
    x = tl.load(logits_ptr + r * row_stride + ids, mask=valid, other=0.0).to(tl.float64)
    factor = tl.load(factors_ptr + r)
    nan = x != x  # noqa: PLR0124 - NaN alone is unequal to itself
    if factor == 0.0:  # greedy: the argmax of the logits, the first NaN if any
        keys = tl.where(nan, 9223372036854775807, _order(tl.where(nan, 0.0, x)))
    else:
        key = _mix64(_mix64(tl.load(seeds_ptr + r)) + tl.load(positions_ptr + r))
        scaled = tl.math.fma(x, factor, 0.0)  # x * factor, rounded once (-0 as +0)
        allowed = scaled > float("-inf")  # not NaN either
        noisy = scaled + _gumbel(key, ids.to(tl.int64))
        # below every float's key (-inf's is -2^63 + 2^52 - 1): a NaN, then a -inf, the tokens nothing allows
        keys = tl.where(allowed, _order(noisy), tl.where(nan | (scaled != scaled), -9223372036854775805,  # noqa: PLR0124
                                                          -9223372036854775806))
    keys = tl.where(valid, keys, -9223372036854775807)  # past the vocabulary: below everything
    best = tl.max(keys, axis=0)
    blocks = tl.cdiv(V, block_V)
    tl.store(keys_ptr + r * blocks + b, best)
    tl.store(ids_ptr + r * blocks + b, tl.min(tl.where(keys == best, ids, V), axis=0))


@triton.jit
def argmax_partials_kernel(keys_ptr, ids_ptr, out_ptr, BLOCKS: tl.constexpr, block_B: tl.constexpr):
    pdl_prologue()
    r = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, block_B)
    valid = j < BLOCKS
    keys = tl.load(keys_ptr + r * BLOCKS + j, mask=valid, other=-9223372036854775807)
    ids = tl.load(ids_ptr + r * BLOCKS + j, mask=valid, other=0)
    best = tl.max(keys, axis=0)
    # the blocks hold ascending tokens: the lowest token among the largest keys is the first
    tl.store(out_ptr + r, tl.min(tl.where(keys == best, ids, 2147483647), axis=0).to(tl.int64))


def default_config(vocab_size: int) -> dict:
    """1024 tokens a program: V4.1's 129280 are 127 programs a row, enough to fill the GPU for one row."""
    return {"block_V": min(1024, triton.next_power_of_2(vocab_size)), "num_warps": 4}


def gumbel_argmax(logits: torch.Tensor, factors: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                  config: dict | None = None) -> torch.Tensor:
    """Each row's token, int64 [R]: the argmax of logits * factor + Gumbel noise (seed, position) over the tokens
    whose scaled logit is above -inf (none: the argmax of the scaled logits), or for a row whose factor is 0 the
    argmax of its logits; ties to the lowest id, NaN first, as torch.argmax.

    logits float32/bfloat16 [R, V] (rows may be strided, tokens contiguous); factors float64 [R] (1 / temperature,
    0: greedy); seeds, positions int64 [R]."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(1) != 1:
        raise ValueError(f"gumbel_argmax's logits must be float32/bfloat16 [R, V] with contiguous rows, got "
                         f"{logits.dtype} {list(logits.shape)} strides {list(logits.stride())}")
    rows, vocab = logits.shape
    for name, t, dtype in (("factors", factors, torch.float64), ("seeds", seeds, torch.int64),
                           ("positions", positions, torch.int64)):
        if t.shape != (rows,) or t.dtype != dtype or not t.is_contiguous() or t.device != logits.device:
            raise ValueError(f"gumbel_argmax's {name} must be contiguous {dtype} [{rows}] on {logits.device}, got "
                             f"{t.dtype} {list(t.shape)} on {t.device}")
    if vocab == 0:
        raise ValueError("gumbel_argmax's logits have no tokens")
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    config = config or default_config(vocab)
    blocks = triton.cdiv(vocab, config["block_V"])
    keys = torch.empty(rows, blocks, dtype=torch.int64, device=logits.device)
    ids = torch.empty(rows, blocks, dtype=torch.int32, device=logits.device)
    launch(gumbel_argmax_kernel, (rows, blocks), (logits, factors, seeds, positions, keys, ids, logits.stride(0)),
           {"V": vocab, "block_V": config["block_V"]}, config["num_warps"], 1)
    launch(argmax_partials_kernel, (rows,), (keys, ids, out),
           {"BLOCKS": blocks, "block_B": triton.next_power_of_2(blocks)}, 4, 1)
    return out


def trace(vocab_size: int, device: str = "meta") -> None:
    """Call the wrapper once on fp32 logits of `vocab_size` tokens on `device` (the AOT builder, on meta, records its
    launches: one variant of each kernel whatever the number of rows)."""
    with torch.device(device):
        ints = torch.zeros(1, dtype=torch.int64)
        gumbel_argmax(torch.zeros(1, vocab_size), torch.zeros(1, dtype=torch.float64), ints, ints)


__all__ = ["KERNEL_NAMES", "argmax_partials_kernel", "default_config", "gumbel_argmax", "gumbel_argmax_kernel",
           "trace"]
