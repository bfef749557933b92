"""Routed experts as two grouped GEMMs over fp4 (e2m1, a power-of-two scale per 32 inputs) or bf16 weights.

Hopper has no fp4 units, so the codes are dequantized in registers, stage by stage (kernels/moe/stages.py). Codes
come raw, [E, out, in/2] (kernels/moe/raw_codes.py), or in fragment order, [E, out/16, in/32, 256]
(kernels/moe/fragments.py: what plans give the kernel, formatted once at load): the same products in the same
order, so the same bits, from 8-byte loads and 8 integer instructions per 8 codes where raw codes take 2-byte loads
and 14 (bench/RESULTS.md).

Routing (kernels/moe/route.py: two launches, static shapes, no host sync): the (token, slot) pairs are sorted
by expert and laid out in blocks of `block_M` slots, each block one expert's (`rows[b*block_M + i]` = pair id or
-1). GEMM 1 gathers each pair's token row and gives h = route_weight * silu(min(x w1, L)) * clamp(x w3, ±L) per
pair; GEMM 2 multiplies by w2. fp4: the rows of x (a bf16 copy made first) and of h hold their even columns, then
their odd ones, so both GEMMs load the two halves a packed byte meets contiguously (gathering x's even and odd fp32
columns with a stride of two instead is the experts' bottleneck, bench/RESULTS.md); the k pairs of a token are summed
at the end in slot order (`moe_sum_kernel`). A decode block holds one or two pairs: only the valid slots' rows of
x or h are read.

One token (a batch-1 decode step, outside batch-invariant configs: `unrouted`) skips routing's two launches and the
sum's: its k pairs run unrouted, block b holding pair b alone, and GEMM 2's last program of each output tile sums
the pairs in slot order (kernels/tickets.py). A pair's products and the sum's order are the routed path's, so are
the bits (`ONE_TOKEN`). x's row keeps its even/odd copy: GEMM 1 reading x in input order (stride-two loads) ran at
half speed (bench/RESULTS.md).

Split-K (a tile choice for decode, where few experts may leave the GPU short of programs; the heuristic's decode tiles
keep K whole, `default_config`): a GEMM's K is cut into `split_k` fixed ranges, one program each, whose fp32 partials
are added in split order: by `moe_swiglu_kernel` before the activation (GEMM 1), by `moe_sum_kernel` inside each slot
(GEMM 2). A pair's products depend only on its row, its expert and the config, not on which block or slot it lands in,
so under a fixed config a token's result does not depend on the batch (batch-invariant runs, graphs/plan.py).
"""

from __future__ import annotations

import torch

from dsl.quant import scale_to_float
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.moe.fragments import UNIT, fragment_products
from kernels.moe.raw_codes import raw_products
from kernels.moe.route import route
from kernels.tickets import last_arrival, tile_counters


@triton.jit
def _h_column(n, N: tl.constexpr, FP4: tl.constexpr):
    """Where GEMM 1's output column n goes in h's rows: fp4's GEMM 2 reads the even ones, then the odd ones."""
    return (n % 2) * (N // 2) + n // 2 if FP4 else n


@triton.jit
def _swiglu(gate, up, route, LIMIT: tl.constexpr):
    if LIMIT > 0:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    return gate * tl.sigmoid(gate) * up * route


@triton.jit
def _plain_products(a_ptr, a_rows, valid, w_ptr, w3_ptr, w_rows, mask_n, k_begin, K: tl.constexpr,
                    K_PER_SPLIT: tl.constexpr, GATED: tl.constexpr, DOT_FP32: tl.constexpr, block_M: tl.constexpr,
                    block_N: tl.constexpr, block_K: tl.constexpr):
    """(x w1^T, x w3^T) over inputs [k_begin, k_begin + K_PER_SPLIT) ∩ [0, K) for bfloat16/float32 weights."""
    acc1 = tl.zeros([block_N, block_M], dtype=tl.float32)
    acc3 = tl.zeros([block_N, block_M], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, block_K):
        ks = k_begin + k0 + tl.arange(0, block_K)
        mask_k = ks < K
        x = tl.load(a_ptr + a_rows[None, :] * K + ks[:, None], mask=valid[None, :] & mask_k[:, None],
                    other=0.0).to(tl.float32)
        mask_w = mask_n[:, None] & mask_k[None, :]
        w = tl.load(w_ptr + w_rows[:, None] * K + ks[None, :], mask=mask_w, other=0.0)
        if DOT_FP32:
            acc1 = tl.dot(w.to(tl.float32), x, acc1, input_precision="ieee")
        else:
            acc1 = tl.dot(w.to(tl.bfloat16), x.to(tl.bfloat16), acc1)
        if GATED:
            w3 = tl.load(w3_ptr + w_rows[:, None] * K + ks[None, :], mask=mask_w, other=0.0)
            if DOT_FP32:
                acc3 = tl.dot(w3.to(tl.float32), x, acc3, input_precision="ieee")
            else:
                acc3 = tl.dot(w3.to(tl.bfloat16), x.to(tl.bfloat16), acc3)
    return acc1, acc3


@triton.jit
def moe_gemm_kernel(a_ptr, rows_ptr, block_expert_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, route_ptr, out_ptr, total_ptr,
                    count_ptr, N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, TOPK: tl.constexpr,
                    GATED: tl.constexpr, FP4: tl.constexpr, LIMIT: tl.constexpr, DOT_FP32: tl.constexpr,
                    ASM: tl.constexpr, SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, FRAGMENTS: tl.constexpr,
                    ONE_TOKEN: tl.constexpr, block_M: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr):
    """One expert block's [block_M slots, block_N outputs] over one K split: GEMM 1 (GATED: w1 and w3, from the
    tokens' rows of x) or GEMM 2 (w2, from the pairs' rows of h).

    ONE_TOKEN: a token's TOPK pairs unrouted. Block b holds pair b alone and its expert is block_expert_ptr[b] (the
    token's picks; one outside [0, E) is skipped, as routing places none of its pairs), and GEMM 2's last program of
    each output tile (kernels/tickets.py) adds the pairs' outputs into total_ptr in slot order, and within a slot in
    split order, as `moe_sum_kernel` does. Each pair's products are those of its routed block, so the token's result
    has the bits of routing, GEMMs and sum."""
    pdl_prologue()
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_TOKEN:
        e = tl.load(block_expert_ptr + pid_b).to(tl.int32)
        e = tl.where((e >= 0) & (e < E), e, -1)
    else:
        e = tl.load(block_expert_ptr + pid_b)
    if e >= 0:
        if ONE_TOKEN:
            pairs = tl.where(tl.arange(0, block_M) == 0, pid_b, -1)
        else:
            pairs = tl.load(rows_ptr + pid_b * block_M + tl.arange(0, block_M))
        valid = pairs >= 0
        pairs = tl.where(valid, pairs, 0).to(tl.int64)  # empty slots compute on pair 0's row, and are not stored
        a_rows = pairs // TOPK if GATED else pairs
        offs_n = pid_n * block_N + tl.arange(0, block_N)
        mask_n = offs_n < N
        w_rows = (e * N + offs_n).to(tl.int64)
        k_begin = split * K_PER_SPLIT
        if FP4 and FRAGMENTS:
            even = (N % block_N == 0) and (K_PER_SPLIT * SPLIT_K == K)
            acc1, acc3 = fragment_products(a_ptr, a_rows, valid, w_ptr, s_ptr, w3_ptr, s3_ptr, e, pid_n * block_N,
                                           w_rows, mask_n, k_begin, N, K, K_PER_SPLIT, GATED, DOT_FP32, ASM, even,
                                           block_M, block_N, block_K)
        elif FP4:
            even = (N % block_N == 0) and (K_PER_SPLIT * SPLIT_K == K)
            acc1, acc3 = raw_products(a_ptr, a_rows, valid, w_ptr, s_ptr, w3_ptr, s3_ptr, w_rows, mask_n, k_begin, K,
                                      K_PER_SPLIT, GATED, DOT_FP32, ASM, even, block_M, block_N, block_K)
        else:
            acc1, acc3 = _plain_products(a_ptr, a_rows, valid, w_ptr, w3_ptr, w_rows, mask_n, k_begin, K,
                                         K_PER_SPLIT, GATED, DOT_FP32, block_M, block_N, block_K)
        mask_out = mask_n[:, None] & valid[None, :]
        if GATED and SPLIT_K == 1:
            act = _swiglu(acc1, acc3, tl.load(route_ptr + pairs)[None, :], LIMIT)
            tl.store(out_ptr + pairs[None, :] * N + _h_column(offs_n, N, FP4)[:, None], act, mask=mask_out)
        elif GATED:  # partials [P, SPLIT_K, 2, N]
            out = out_ptr + ((pairs[None, :] * SPLIT_K + split) * 2) * N + offs_n[:, None]
            tl.store(out, acc1, mask=mask_out)
            tl.store(out + N, acc3, mask=mask_out)
        else:  # [P, SPLIT_K, N]
            tl.store(out_ptr + (pairs[None, :] * SPLIT_K + split) * N + offs_n[:, None], acc1, mask=mask_out)
    if ONE_TOKEN and not GATED:
        if last_arrival(count_ptr, pid_n, TOPK * SPLIT_K):
            offs = pid_n * block_N + tl.arange(0, block_N)
            total = tl.zeros([block_N], dtype=tl.float32)
            for slot in tl.static_range(TOPK):
                for s in tl.static_range(SPLIT_K):
                    total += tl.load(out_ptr + (slot * SPLIT_K + s) * N + offs, mask=offs < N, other=0.0,
                                     cache_modifier=".cg")
            tl.store(total_ptr + offs, total, mask=offs < N)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit
def moe_swiglu_kernel(ws_ptr, route_ptr, h_ptr, N: tl.constexpr, SPLIT_K: tl.constexpr, LIMIT: tl.constexpr,
                      FP4: tl.constexpr, block_N: tl.constexpr):
    """GEMM 1's split-K partials [P, SPLIT_K, 2, N] of one pair, added in split order, through the activation."""
    pdl_prologue()
    pair = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * block_N + tl.arange(0, block_N)
    mask = offs < N
    gate = tl.zeros([block_N], dtype=tl.float32)
    up = tl.zeros([block_N], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        base = ws_ptr + (pair * SPLIT_K + s) * 2 * N
        gate += tl.load(base + offs, mask=mask, other=0.0)
        up += tl.load(base + N + offs, mask=mask, other=0.0)
    act = _swiglu(gate, up, tl.load(route_ptr + pair), LIMIT)
    tl.store(h_ptr + pair * N + _h_column(offs, N, FP4), act, mask=mask)


@triton.jit
def moe_sum_kernel(y_ptr, out_ptr, D: tl.constexpr, TOPK: tl.constexpr, SPLIT_K: tl.constexpr,
                   block_D: tl.constexpr):
    """out[t] = the sum over slots, and within a slot over splits, of y [T*TOPK, SPLIT_K, D], in that order."""
    pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * block_D + tl.arange(0, block_D)
    mask = offs < D
    acc = tl.zeros([block_D], dtype=tl.float32)
    for slot in tl.static_range(TOPK):
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(y_ptr + ((t * TOPK + slot) * SPLIT_K + s) * D + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * D + offs, acc, mask=mask)


@triton.jit
def split_rows_kernel(x_ptr, out_ptr, D: tl.constexpr, block: tl.constexpr):
    """out[t] = x[t]'s even inputs, then its odd ones, converted to out's dtype (round to nearest even, as torch's
    cast): what torch.cat([x[:, 0::2], x[:, 1::2]], 1).to(dtype) gives, in one launch instead of two."""
    pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * block + tl.arange(0, block)
    mask = offs < D
    src = tl.where(offs < D // 2, 2 * offs, 2 * (offs - D // 2) + 1)
    v = tl.load(x_ptr + t * D + src, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


DECODE_TOKENS = 512  # buckets up to here take the decode tiles, and the smallest of them serves one token


def default_config(m: int, fp4: bool = True) -> dict:
    """The heuristic tiles for a token count `m` (a bucket's upper end). Up to 512 tokens: 16 slots x 128 outputs x 128
    inputs, 8 warps, 3 stages, K unsplit: the fastest on fragment-order codes at 16 and 64 tokens of the H100 sweep
    bench/RESULTS.md records (`bench/bench_moe_decode.py --sweep`), faster than the split tiles it replaces at one
    token, and 1.04-1.09x the 16 x 64 tiles of 4 warps at 128 to 512 tokens. Splitting K put more programs in flight
    for the raw codes' slower loop (the H200's sweep chose 4/2 up to 16 tokens on those); on fragments, from 16 tokens
    every split measured slower than K whole, at one token a 2/1 split was a little faster, and a fourth stage was
    slower in all but one pair. Beyond 512 tokens (prefill), 64 slots a block in 128 x 64 tiles with 8 warps, so each
    dequantized weight tile serves four times the pairs."""
    if m <= DECODE_TOKENS:
        gemm = {"block_M": 16, "block_N": 128, "block_K": 128, "num_warps": 8, "num_stages": 3}
    else:
        gemm = {"block_M": 64, "block_N": 128, "block_K": 64, "num_warps": 8, "num_stages": 3}
    return {"up": dict(gemm, split_k=1), "down": dict(gemm, split_k=1)}


def expert_shape(w: torch.Tensor) -> tuple[int, int, int]:
    """(experts, outputs, inputs) of stacked expert weights: [E, out, in] floats, [E, out, in/2] packed fp4 codes, or
    [E, out/16, in/32, 256] fp4 codes in fragment order (kernels/moe/fragments.py)."""
    if w.dtype == torch.uint8 and w.dim() == 4 and w.shape[3] == UNIT:
        return w.shape[0], 16 * w.shape[1], 32 * w.shape[2]
    if w.dim() != 3:
        raise ValueError(f"expert weights must be [E, out, in], packed fp4 or in fragment order, got {list(w.shape)}")
    return w.shape[0], w.shape[1], w.shape[2] * (2 if w.dtype == torch.uint8 else 1)


def _check(x, weights, experts, ws: list[torch.Tensor], scales: list[torch.Tensor | None]) -> bool:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"x must be contiguous float32/bfloat16 [T, D], got {x.dtype} {list(x.shape)}")
    t = x.shape[0]
    if experts.shape != weights.shape or experts.dim() != 2 or experts.shape[0] != t:
        raise ValueError(f"weights and experts must both be [{t}, k], got {list(weights.shape)}, {list(experts.shape)}")
    if weights.dtype != torch.float32 or experts.dtype not in (torch.int64, torch.int32):
        raise TypeError("weights must be float32 and experts int32/int64")
    fp4 = ws[0].dtype == torch.uint8
    if fp4 and len({getattr(s, "dtype", None) for s in scales}) != 1:
        raise TypeError(f"s1, s2, s3 must share a dtype, got {[getattr(s, 'dtype', None) for s in scales]}")
    if len({w.dim() for w in ws}) != 1:
        raise ValueError("w1, w2, w3 must share one layout")
    shapes = [expert_shape(w) for w in ws]
    for w, s, (e, o, i) in zip(ws, scales, shapes, strict=True):
        if not w.is_contiguous() or (w.dtype == torch.uint8) != fp4:
            raise ValueError("w1, w2, w3 must be contiguous and of one format")
        if fp4:
            want = (e, o, triton.cdiv(i, 32))
            if s is None or tuple(s.shape) != want or s.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"fp4 weight {list(w.shape)} needs scales {list(want)}: float32, or bfloat16 from "
                                 f"`prescaled`")
        elif w.dtype not in (torch.bfloat16, torch.float32) or s is not None:
            raise TypeError(f"plain expert weights are bfloat16/float32 without scales, got {w.dtype}")
    (e1, inter, d1), (e2, d2, inter2), shape3 = shapes
    if d1 != x.shape[1] or shape3 != shapes[0] or d2 != x.shape[1] or inter2 != inter or e2 != e1:
        raise ValueError(f"expert shapes do not chain: x {list(x.shape)}, w1 {list(ws[0].shape)}, "
                         f"w2 {list(ws[1].shape)}, w3 {list(ws[2].shape)}")
    if fp4 and (d1 % 32 or inter % 32):
        raise ValueError("fp4 experts need dims that are multiples of 32")
    return fp4


def prescaled(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales (fp32 or ue8m0) as the bf16 factor the fp4 products multiply codes by, scale * 2^63: exact
    for every ue8m0 scale up to 2^64, inf past it (as the kernel's own product from an fp32 scale). The kernel then
    skips that product and its conversion, and reads 2 bytes a scale, not 4: faster at decode sizes, slower at
    prefill ones (bench/RESULTS.md)."""
    return (scale_to_float(scale) * 2.0**63).to(torch.bfloat16)


def _split(gemm: dict, k: int) -> tuple[int, int]:
    """(split count, K per split): whole block_K stages per split (the last may be shorter)."""
    split, block_k = gemm["split_k"], gemm["block_K"]
    if split < 1 or block_k % 32:
        raise ValueError(f"split_k must be >= 1 and block_K a multiple of 32, got {split}, {block_k}")
    return split, triton.cdiv(triton.cdiv(k, split), block_k) * block_k


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, s1: torch.Tensor | None = None, s2: torch.Tensor | None = None,
                s3: torch.Tensor | None = None, *, limit: float, config: dict | None = None,
                dot_fp32: bool = False) -> torch.Tensor:
    """sum over each token's k experts of weight * w2(silu(min(w1 x, L)) * clamp(w3 x, ±L)): x [T, D] -> fp32 [T, D].

    weights fp32 [T, k], experts int [T, k]. w1, w3 [E, I, D], w2 [E, D, I]: packed fp4 (uint8, [.., in/2], or
    [E, out/16, in/32, 256] in fragment order from `fragments.fragment_codes`: the same products, faster) with
    power-of-two scales [E, out, in/32] (fp32, or bf16 scale * 2^63 from `prescaled`: the same products, half the
    scale bytes, and faster at decode), or bfloat16/float32. `config`: {"up": tiles, "down": tiles} for the
    two GEMMs (block_M, block_N, block_K, num_warps, num_stages, split_k).
    """
    fp4 = _check(x, weights, experts, [w1, w2, w3], [s1, s2, s3])
    t = experts.shape[0]
    if t == 0:
        return torch.empty(t, x.shape[1], dtype=torch.float32, device=x.device)
    config = config or default_config(t, fp4)
    rows = gemm_rows(x, fp4, dot_fp32)
    if unrouted(t, config):  # no routing, the pairs summed inside GEMM 2: the same bits
        total = torch.empty(1, x.shape[1], dtype=torch.float32, device=x.device)
        pair_outputs(rows, weights, experts, w1, w2, w3, s1, s2, s3, limit=limit, config=config, dot_fp32=dot_fp32,
                     total=total)
        return total
    y = pair_outputs(rows, weights, experts, w1, w2, w3, s1, s2, s3, limit=limit, config=config, dot_fp32=dot_fp32)
    return sum_pairs(y, experts.shape[1])


def unrouted(tokens: int, config: dict) -> bool:
    """Whether `moe_experts` runs `tokens` tokens unrouted under `config`: one token, unless the config routes every
    count (`unrouted` False: batch-invariant configs launch the same kernels whatever the batch, graphs/plan.py)."""
    return tokens == 1 and config.get("unrouted", True)


def gemm_rows(x: torch.Tensor, fp4: bool, dot_fp32: bool) -> torch.Tensor:
    """The token rows GEMM 1 reads: for fp4 weights each row's even inputs, then its odd ones, in the products'
    dtype (bf16; fp32 with `dot_fp32`), as h is laid out for GEMM 2 (`split_rows_kernel`, one launch); x itself for
    float weights."""
    if not fp4:
        return x
    t, d = x.shape
    out = torch.empty(t, d, dtype=torch.float32 if dot_fp32 else torch.bfloat16, device=x.device)
    block = min(1024, triton.next_power_of_2(max(d, 1)))
    launch(split_rows_kernel, (t, triton.cdiv(d, block)), (x, out), dict(D=d, block=block), 4, 1)
    return out


def pair_outputs(xk: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                 w3: torch.Tensor, s1: torch.Tensor | None, s2: torch.Tensor | None, s3: torch.Tensor | None, *,
                 limit: float, config: dict, dot_fp32: bool, total: torch.Tensor | None = None) -> torch.Tensor:
    """Every (token, slot) pair's weight * expert(x) as GEMM 2's split-K partials, fp32 [T*k, split_k, D] (pair
    t*k + slot), from the rows `gemm_rows` made; experts whose id is outside [0, E) are not computed.

    `total` fp32 [1, D], for one token (T = 1): its pairs run unrouted (`moe_gemm_kernel`'s ONE_TOKEN), and GEMM 2
    also writes the sum of the pairs' outputs into `total`, `sum_pairs`'s bits."""
    fp4, fragments = w1.dtype == torch.uint8, w1.dim() == 4
    t, topk = experts.shape
    num_experts, inter, d = expert_shape(w1)
    up, down = config["up"], config["down"]
    if up["block_M"] != down["block_M"]:
        raise ValueError("both GEMMs read one routing layout: their block_M must match")
    if fragments and (up["block_N"] % 16 or down["block_N"] % 16):
        raise ValueError("codes in fragment order come in groups of 16 rows: block_N must be a multiple of 16")
    one_token = total is not None
    if one_token and (t != 1 or total.shape != (1, d) or total.dtype != torch.float32):
        raise ValueError(f"a total is one token's fp32 [1, {d}], got {t} tokens and {total.dtype} "
                         f"{list(total.shape)}")
    (split_up, per_up), (split_down, per_down) = _split(up, d), _split(down, inter)
    pairs, dev = t * topk, xk.device
    asm = dev.type != "cpu" and not dot_fp32  # the interpreter (CPU tensors) runs no PTX; meta tensors: the AOT build
    if pairs == 0:
        return torch.empty(pairs, split_down, d, dtype=torch.float32, device=dev)
    if one_token:  # block b is pair b: the token's picks are the blocks' experts
        block_expert = rows = experts.reshape(-1).contiguous()
        counters = tile_counters(dev, triton.cdiv(d, down["block_N"]))
    else:
        rows, block_expert = route(experts, num_experts, up["block_M"])
    h = torch.empty(pairs, inter, dtype=torch.float32 if dot_fp32 else torch.bfloat16, device=dev)
    part = h if split_up == 1 else torch.empty(pairs, split_up, 2, inter, dtype=torch.float32, device=dev)
    y = torch.empty(pairs, split_down, d, dtype=torch.float32, device=dev)
    if not one_token:  # unread
        total = counters = y
    common = dict(E=num_experts, TOPK=topk, FP4=fp4, LIMIT=float(limit), DOT_FP32=dot_fp32, ASM=asm,
                  FRAGMENTS=fragments, ONE_TOKEN=one_token, block_M=up["block_M"])
    s1_, s2_, s3_ = (s1, s2, s3) if fp4 else (w1, w2, w3)
    if fragments:  # the kernels load whole words of the format (kernels/moe/fragments.py)
        w1, w2, w3 = (w.view(torch.int32) for w in (w1, w2, w3))
    launch(moe_gemm_kernel, (block_expert.numel(), triton.cdiv(inter, up["block_N"]), split_up),
           (xk, rows, block_expert, w1, s1_, w3, s3_, weights, part, total, counters),
           dict(common, N=inter, K=d, GATED=True, SPLIT_K=split_up, K_PER_SPLIT=per_up, block_N=up["block_N"],
                block_K=up["block_K"]), up["num_warps"], up["num_stages"])
    if split_up > 1:
        block = min(1024, triton.next_power_of_2(inter))
        launch(moe_swiglu_kernel, (pairs, triton.cdiv(inter, block)), (part, weights, h),
               dict(N=inter, SPLIT_K=split_up, LIMIT=float(limit), FP4=fp4, block_N=block), 4, 1)
    launch(moe_gemm_kernel, (block_expert.numel(), triton.cdiv(d, down["block_N"]), split_down),
           (h, rows, block_expert, w2, s2_, w2, s2_, weights, y, total, counters),
           dict(common, N=d, K=inter, GATED=False, SPLIT_K=split_down, K_PER_SPLIT=per_down,
                block_N=down["block_N"], block_K=down["block_K"]), down["num_warps"], down["num_stages"])
    return y


def sum_pairs(y: torch.Tensor, topk: int) -> torch.Tensor:
    """Each token's pair outputs y fp32 [T*topk, split_k, D] added in slot order, and within a slot in split order,
    into fp32 zeros: [T, D]."""
    if y.dim() != 3 or y.dtype != torch.float32 or not y.is_contiguous() or y.shape[0] % max(topk, 1):
        raise ValueError(f"pair outputs must be contiguous float32 [T*{topk}, split_k, D], got {y.dtype} "
                         f"{list(y.shape)}")
    t, d = y.shape[0] // max(topk, 1), y.shape[2]
    out = torch.empty(t, d, dtype=torch.float32, device=y.device)
    block = min(1024, triton.next_power_of_2(d))
    launch(moe_sum_kernel, (t, triton.cdiv(d, block)), (y, out), dict(D=d, TOPK=topk, SPLIT_K=y.shape[1],
                                                                       block_D=block), 4, 1)
    return out


__all__ = ["default_config", "gemm_rows", "moe_experts", "moe_gemm_kernel", "moe_sum_kernel", "moe_swiglu_kernel",
           "pair_outputs", "split_rows_kernel", "sum_pairs", "unrouted"]
