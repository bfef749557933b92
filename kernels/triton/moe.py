"""Routed experts as two grouped GEMMs over fp4 (e2m1, a power-of-two scale per 32 inputs) or bf16 weights.

Hopper has no fp4 units, so the codes are dequantized in registers, in few integer operations: a code's
magnitude bits (e, m) placed as an fp16 exponent's low bits and mantissa's top bit, `(code & 7) << 9`, read as
fp16 2^(e-15) * (1 + m/2), or m * 2^-15 for e = 0 (an fp16 subnormal, exact): the e2m1 value times 2^-14, a factor
folded into the block scale. The even and odd input columns of a packed byte meet the even and odd activations in
two products, so nothing is interleaved.

Routing (torch, static shapes, no host sync): the (token, slot) pairs are sorted by expert and laid out in
blocks of `block_M` slots, each block one expert's (`rows[b*block_M + i]` = pair id or -1). GEMM 1 gathers each
pair's token row and writes route_weight * silu(min(x w1, L)) * clamp(x w3, ±L) per slot; GEMM 2 multiplies by
w2 and scatters to the pair's row; the k pairs of a token are summed at the end, in slot order. A pair's products
do not depend on which block or slot it lands in, so under a fixed config a token's result does not depend on the
batch (batch-invariant runs, graphs/plan.py).
"""

from __future__ import annotations

import torch

from kernels.launch import launch
from kernels.triton.lang import tl, triton


@triton.jit
def moe_gemm_kernel(a_ptr, rows_ptr, block_expert_ptr, w_ptr, s_ptr, w3_ptr, s3_ptr, route_ptr, out_ptr,
                    N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATED: tl.constexpr, FP4: tl.constexpr,
                    LIMIT: tl.constexpr, DOT_FP32: tl.constexpr, block_M: tl.constexpr, block_N: tl.constexpr,
                    block_K: tl.constexpr):
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert_ptr + pid_b)
    if e >= 0:
        slots = pid_b * block_M + tl.arange(0, block_M)
        pairs = tl.load(rows_ptr + slots)
        valid = pairs >= 0
        a_rows = (pairs // TOPK) if GATED else slots  # GEMM 1 gathers token rows; GEMM 2 reads its own slots
        a_rows = a_rows.to(tl.int64)
        offs_n = pid_n * block_N + tl.arange(0, block_N)
        mask_n = offs_n < N
        w_rows = (e * N + offs_n).to(tl.int64)
        acc1 = tl.zeros([block_N, block_M], dtype=tl.float32)
        acc3 = tl.zeros([block_N, block_M], dtype=tl.float32)
        if FP4:
            KP: tl.constexpr = K // 2
            SC: tl.constexpr = (K + 31) // 32
            for k0 in range(0, K, block_K):
                kh = k0 // 2 + tl.arange(0, block_K // 2)  # packed column: inputs 2*kh (low nibble), 2*kh + 1
                mask_k = kh < KP
                mask_w = mask_n[:, None] & mask_k[None, :]
                sg = k0 // 32 + tl.arange(0, block_K // 32)
                mask_s = mask_n[:, None] & (sg < SC)[None, :]
                xa = a_ptr + a_rows[None, :] * K + 2 * kh[:, None]
                mask_x = valid[None, :] & mask_k[:, None]
                x_even = tl.load(xa, mask=mask_x, other=0.0).to(tl.float32)  # [block_K/2, block_M]
                x_odd = tl.load(xa + 1, mask=mask_x, other=0.0).to(tl.float32)
                if not DOT_FP32:
                    x_even = x_even.to(tl.bfloat16)
                    x_odd = x_odd.to(tl.bfloat16)
                for which in tl.static_range(2 if GATED else 1):
                    wp = w_ptr if which == 0 else w3_ptr
                    sp = s_ptr if which == 0 else s3_ptr
                    b = tl.load(wp + w_rows[:, None] * KP + kh[None, :], mask=mask_w, other=0).to(tl.int32)
                    sc = tl.load(sp + w_rows[:, None] * SC + sg[None, :], mask=mask_s, other=0.0) * 16384.0
                    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [block_N, block_K // 32, 16]),
                                    [block_N, block_K // 2])
                    for half in tl.static_range(2):
                        # the code's 3 magnitude bits as an fp16 exponent/mantissa (sign to bit 15): the fp16
                        # value is the e2m1 value * 2^-14 (e = 0 lands on fp16 subnormals, exact), 2^14 is in `sc`
                        if half == 0:
                            bits = ((b & 7) << 9) | ((b & 8) << 12)
                        else:
                            bits = ((b & 0x70) << 5) | ((b & 0x80) << 8)
                        v = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * sc  # [block_N, block_K/2]
                        xh = x_even if half == 0 else x_odd
                        if not DOT_FP32:
                            v = v.to(tl.bfloat16)
                        if which == 0:
                            acc1 = tl.dot(v, xh, acc1, input_precision="ieee" if DOT_FP32 else None)
                        else:
                            acc3 = tl.dot(v, xh, acc3, input_precision="ieee" if DOT_FP32 else None)
        else:
            for k0 in range(0, K, block_K):
                ks = k0 + tl.arange(0, block_K)
                mask_k = ks < K
                x = tl.load(a_ptr + a_rows[None, :] * K + ks[:, None], mask=valid[None, :] & mask_k[:, None],
                            other=0.0).to(tl.float32)
                w = tl.load(w_ptr + w_rows[:, None] * K + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                            other=0.0)
                if DOT_FP32:
                    acc1 = tl.dot(w.to(tl.float32), x, acc1, input_precision="ieee")
                else:
                    acc1 = tl.dot(w.to(tl.bfloat16), x.to(tl.bfloat16), acc1)
                if GATED:
                    w3 = tl.load(w3_ptr + w_rows[:, None] * K + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                                 other=0.0)
                    if DOT_FP32:
                        acc3 = tl.dot(w3.to(tl.float32), x, acc3, input_precision="ieee")
                    else:
                        acc3 = tl.dot(w3.to(tl.bfloat16), x.to(tl.bfloat16), acc3)
        mask_out = mask_n[:, None] & valid[None, :]
        if GATED:
            gate = acc1
            up = acc3
            if LIMIT > 0:
                gate = tl.minimum(gate, LIMIT)
                up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            act = gate * tl.sigmoid(gate) * up * tl.load(route_ptr + pairs, mask=valid, other=0.0)[None, :]
            tl.store(out_ptr + slots[None, :].to(tl.int64) * N + offs_n[:, None], act, mask=mask_out)
        else:
            tl.store(out_ptr + pairs[None, :].to(tl.int64) * N + offs_n[:, None], acc1, mask=mask_out)


def route(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lay the (token, slot) pairs of `experts` [T, k] out in blocks of `block_m` slots, each of one expert.

    Returns rows int32 [B * block_m] (pair id t*k + slot, or -1) and block_expert int32 [B] (-1: unused block),
    B = ceil((P + min(E, P) * (block_m - 1)) / block_m) for P = T*k pairs: a bound fixed by the shapes, so the
    launch grid needs no host sync.
    """
    flat = experts.reshape(-1)
    p = flat.numel()
    dev = flat.device
    num_blocks = triton.cdiv(p + min(num_experts, p) * (block_m - 1), block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    slot = (block_end - blocks)[sorted_e] * block_m + torch.arange(p, device=dev) - first[sorted_e]
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    rows.scatter_(0, slot, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


def default_config(m: int, fp4: bool = True) -> dict:
    # block_K 256 with fp4 spills registers in GEMM 1 (two weights dequantized per stage): 128 does not
    gemm = {"block_M": 16, "block_N": 64, "block_K": 128, "num_warps": 4, "num_stages": 3}
    return {"up": dict(gemm), "down": dict(gemm)}


def _check(x, weights, experts, ws: list[torch.Tensor], scales: list[torch.Tensor | None]) -> bool:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"x must be contiguous float32/bfloat16 [T, D], got {x.dtype} {list(x.shape)}")
    t = x.shape[0]
    if experts.shape != weights.shape or experts.dim() != 2 or experts.shape[0] != t:
        raise ValueError(f"weights and experts must both be [{t}, k], got {list(weights.shape)}, {list(experts.shape)}")
    if weights.dtype != torch.float32 or experts.dtype not in (torch.int64, torch.int32):
        raise TypeError("weights must be float32 and experts int32/int64")
    fp4 = ws[0].dtype == torch.uint8
    for w, s in zip(ws, scales, strict=True):
        if w.dim() != 3 or not w.is_contiguous() or (w.dtype == torch.uint8) != fp4:
            raise ValueError("w1, w2, w3 must be contiguous [E, out, in] of one format")
        if fp4:
            e, o, half = w.shape
            want = (e, o, triton.cdiv(2 * half, 32))
            if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
                raise ValueError(f"fp4 weight {list(w.shape)} needs float32 scales {list(want)}")
        elif w.dtype not in (torch.bfloat16, torch.float32) or s is not None:
            raise TypeError(f"plain expert weights are bfloat16/float32 without scales, got {w.dtype}")
    d, inter = x.shape[1], ws[0].shape[1]
    k_mult = 2 if fp4 else 1
    if ws[0].shape[2] * k_mult != d or ws[2].shape[1:] != ws[0].shape[1:] or ws[1].shape[1] != d \
            or ws[1].shape[2] * k_mult != inter:
        raise ValueError(f"expert shapes do not chain: x {list(x.shape)}, w1 {list(ws[0].shape)}, "
                         f"w2 {list(ws[1].shape)}, w3 {list(ws[2].shape)}")
    if fp4 and (d % 32 or inter % 32):
        raise ValueError("fp4 experts need dims that are multiples of 32")
    return fp4


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, s1: torch.Tensor | None = None, s2: torch.Tensor | None = None,
                s3: torch.Tensor | None = None, *, limit: float, config: dict | None = None,
                dot_fp32: bool = False) -> torch.Tensor:
    """sum over each token's k experts of weight * w2(silu(min(w1 x, L)) * clamp(w3 x, ±L)): x [T, D] -> fp32 [T, D].

    weights fp32 [T, k], experts int [T, k]. w1, w3 [E, I, D], w2 [E, D, I]: packed fp4 (uint8, [.., in/2]) with
    fp32 scales [E, out, in/32], or bfloat16/float32.
    """
    fp4 = _check(x, weights, experts, [w1, w2, w3], [s1, s2, s3])
    t, topk = experts.shape
    num_experts, inter, d = w1.shape[0], w1.shape[1], x.shape[1]
    out = torch.empty(t, d, dtype=torch.float32, device=x.device)
    if t == 0:
        return out
    config = config or default_config(t, fp4)
    up, down = config["up"], config["down"]
    if up["block_M"] != down["block_M"]:
        raise ValueError("both GEMMs read one routing layout: their block_M must match")
    rows, block_expert = route(experts, num_experts, up["block_M"])
    act_dtype = torch.float32 if dot_fp32 else torch.bfloat16
    h = torch.empty(rows.numel(), inter, dtype=act_dtype, device=x.device)
    y = torch.empty(t * topk, d, dtype=torch.float32, device=x.device)
    common = dict(TOPK=topk, FP4=fp4, LIMIT=float(limit), DOT_FP32=dot_fp32, block_M=up["block_M"])
    s1_, s2_, s3_ = (s1, s2, s3) if fp4 else (w1, w2, w3)
    launch(moe_gemm_kernel, (block_expert.numel(), triton.cdiv(inter, up["block_N"])),
           (x, rows, block_expert, w1, s1_, w3, s3_, weights, h),
           dict(common, N=inter, K=d, GATED=True, block_N=up["block_N"], block_K=up["block_K"]),
           up["num_warps"], up["num_stages"])
    launch(moe_gemm_kernel, (block_expert.numel(), triton.cdiv(d, down["block_N"])),
           (h, rows, block_expert, w2, s2_, w2, s2_, weights, y),
           dict(common, N=d, K=inter, GATED=False, block_N=down["block_N"], block_K=down["block_K"]),
           down["num_warps"], down["num_stages"])
    torch.sum(y.view(t, topk, d), dim=1, out=out)
    return out


__all__ = ["moe_experts", "route", "default_config", "moe_gemm_kernel"]
