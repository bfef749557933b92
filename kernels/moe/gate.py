"""The MoE gate after its projection (`dsl.ops.moe.gate_topk`): each token's scores, its top-k experts by score + bias
and their weights, in one launch where torch makes ten ops (divide, softplus, sqrt, add, top-k, gather, sum, add,
divide, scale: sqrtsoftplus renormalised).

`gate_topk(logits, bias, ...)` takes the projection's logits fp32 [N, E] and the bias [E] and writes weights fp32 [N, k]
and experts int64 [N, k]. One program a token row holds the row's E scores in registers (E <= 4096):
- scores as the reference computes them on the GPU, from the same CUDA math functions (libdevice's expf and log1pf,
  correctly rounded division and square root): sqrtsoftplus sqrt(x > 20 ? x : log1p(exp(x))), sigmoid
  1 / (1 + exp(-x)), softmax exp(x - max) / sum. `logits / temp` is `logits * (1 / temp)` with the reciprocal
  rounded to fp32 first, as torch's CUDA division by a number does (exact at temp = 1). Under Triton's interpreter
  (no libdevice) exp and log are numpy's and log1p is log(u) * y / (u - 1) for u = 1 + y: a few ulps off;
- the top k by repeated maxima of one int64 key a lane: the fp32 bits of score + bias mapped to a signed order
  (negatives' magnitude bits flipped, -0.0 as +0.0) above E - 1 - expert. So the experts come in descending
  score + bias, as torch.topk gives them, and equal values go lowest expert first (torch leaves that order open);
- the weights are the unbiased scores of the picks, renormalised (divided by their sum, added in slot order, + 1e-20)
  when `normalize` and k > 1, then times `scaling`.

One token (a batch-1 decode step) runs its projection and top k in one launch, `gate_one_row_kernel`: the one-row
projection of kernels/linear/gemv.py, then, in the program that completes the last tile of logits (kernels/tickets.py),
the same top k; the bits of the two launches it replaces.

So on the GPU the selections and unnormalised weights of sqrtsoftplus and sigmoid are meant to be torch's bits (the
gpu tests check it): the PTX of their scores is, instruction for instruction, nvcc's for torch's expressions (seen
for sm_90a with CUDA 13), but that Triton links libdevice flushing subnormals, so a logit below about -87 scores 0
where torch's sqrtsoftplus gives about 1e-19. Softmax's sum and the renormalising sum add in another order than
torch's reductions: within fp32 rounding. A row's result is its own: the same bits alone or in any batch.
"""

from __future__ import annotations

import torch

from kernels import tickets
from kernels.lang import libdevice, pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.linear import linear
from kernels.linear.gemv import _row_sums, _split_sum
from kernels.tickets import last_arrival

FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@triton.jit
def _exp(x, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.exp(x)
    return tl.exp(x)


@triton.jit
def _log1p(y, EXACT: tl.constexpr):
    if EXACT:
        return libdevice.log1p(y)
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * (y / (u - 1.0)))


@triton.jit
def _scores(x, mask, FUNC: tl.constexpr, EXACT: tl.constexpr):
    """score(x) over one row's lanes [block_E]; lanes outside `mask` are ignored by softmax's max and sum."""
    if FUNC == "sqrtsoftplus":
        return tl.sqrt_rn(tl.where(x > 20.0, x, _log1p(_exp(x, EXACT), EXACT)))
    elif FUNC == "sigmoid":
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, EXACT))
    else:
        e = tl.where(mask, _exp(x - tl.max(tl.where(mask, x, float("-inf")), axis=0), EXACT), 0.0)
        return tl.math.div_rn(e, tl.broadcast_to(tl.sum(e, axis=0), x.shape))


@triton.jit
def _top_k(x, lanes, mask, bias_ptr, weights_ptr, experts_ptr, row, E: tl.constexpr, TOPK: tl.constexpr,
           FUNC: tl.constexpr, NORMALIZE: tl.constexpr, SCALING: tl.constexpr, EXACT: tl.constexpr,
           block_K: tl.constexpr):
    """Row `row`'s logits x (already divided by the temperature) over `lanes` [block_E]: its top k experts and their
    weights, stored at row * TOPK."""
    scores = _scores(x, mask, FUNC, EXACT)  # [block_E]
    biased = scores + tl.load(bias_ptr + lanes, mask=mask, other=0.0)
    bits = tl.where(biased == 0.0, 0.0, biased).to(tl.int32, bitcast=True)
    order = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed order of the floats
    keys = tl.where(mask, (order.to(tl.int64) << 32) | (E - 1 - lanes), -(2**63))  # [block_E], one per lane
    slots = tl.arange(0, block_K)
    experts = tl.zeros([block_K], dtype=tl.int64)
    weights = tl.zeros([block_K], dtype=tl.float32)
    total = 0.0  # the picks' scores added in slot order
    for i in tl.static_range(TOPK):
        e = (E - 1) - (tl.max(keys, axis=0) & 0x7FFFFFFF)
        picked = lanes == e
        w = tl.max(tl.where(picked, scores, float("-inf")), axis=0)
        keys = tl.where(picked, -(2**63), keys)
        experts = tl.where(slots == i, e, experts)
        weights = tl.where(slots == i, w, weights)
        total += w
    if NORMALIZE:
        weights = tl.math.div_rn(weights, tl.broadcast_to(total + 1e-20, [block_K]))
    out = row * TOPK + slots
    tl.store(weights_ptr + out, weights * SCALING, mask=slots < TOPK)
    tl.store(experts_ptr + out, experts, mask=slots < TOPK)


@triton.jit
def gate_topk_kernel(logits_ptr, bias_ptr, weights_ptr, experts_ptr, E: tl.constexpr, TOPK: tl.constexpr,
                     FUNC: tl.constexpr, INV_TEMP: tl.constexpr, NORMALIZE: tl.constexpr, SCALING: tl.constexpr,
                     EXACT: tl.constexpr, block_E: tl.constexpr, block_K: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, block_E)
    mask = lanes < E
    x = tl.load(logits_ptr + row * E + lanes, mask=mask, other=0.0) * INV_TEMP
    _top_k(x, lanes, mask, bias_ptr, weights_ptr, experts_ptr, row, E, TOPK, FUNC, NORMALIZE, SCALING, EXACT, block_K)


@triton.jit
def gate_one_row_kernel(x_ptr, w_ptr, ws_ptr, logits_ptr, count_ptr, bias_ptr, weights_ptr, experts_ptr,
                        E: tl.constexpr, K: tl.constexpr, SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                        TOPK: tl.constexpr, FUNC: tl.constexpr, INV_TEMP: tl.constexpr, NORMALIZE: tl.constexpr,
                        SCALING: tl.constexpr, EXACT: tl.constexpr, block_N: tl.constexpr, block_K: tl.constexpr,
                        block_E: tl.constexpr, block_TOPK: tl.constexpr):
    """One token's gate in one launch: the projection as kernels/linear/gemv.py's `gemv_kernel` computes it (fp32
    weights [E, K]; grid (E tiles, SPLIT_K), a tile's last program summing its splits), each tile's logits stored;
    then the program that completes the last tile (a second ticket, counter E tiles) runs `gate_topk_kernel`'s top k
    over them. The bits of those two launches."""
    pdl_prologue()
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    tiles = tl.num_programs(0)
    rows, mask_n, acc = _row_sums(x_ptr, w_ptr, w_ptr, 0, split, pid_n, E, K, 0, False, K_PER_SPLIT, block_N, block_K)
    if SPLIT_K == 1:
        tl.store(logits_ptr + rows, acc, mask=mask_n)
        finished = True
    else:
        tl.store(ws_ptr + split * E + rows, acc, mask=mask_n)
        finished = last_arrival(count_ptr, pid_n, SPLIT_K)
        if finished:
            tl.store(logits_ptr + rows, _split_sum(ws_ptr, rows, mask_n, E, SPLIT_K, block_N), mask=mask_n)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
    if finished:
        if last_arrival(count_ptr, tiles, tiles):  # every tile's logits stored: read them from L2
            lanes = tl.arange(0, block_E)
            mask = lanes < E
            x = tl.load(logits_ptr + lanes, mask=mask, other=0.0, cache_modifier=".cg") * INV_TEMP
            _top_k(x, lanes, mask, bias_ptr, weights_ptr, experts_ptr, 0, E, TOPK, FUNC, NORMALIZE, SCALING, EXACT,
                   block_TOPK)
            tl.atomic_xchg(count_ptr + tiles, 0, sem="relaxed", scope="gpu")


def default_config(e: int) -> dict:
    """Two warps for V4.1's 384 experts (512 lanes, 8 a thread), so the maxima stay mostly within a warp (not
    measured)."""
    return {"num_warps": max(1, min(8, triton.next_power_of_2(e) // 256))}


def _check(e: int, bias: torch.Tensor, topk: int, func: str, temp: float) -> None:
    if bias.shape != (e,) or bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError(f"gate_topk's bias must be contiguous float32 [{e}], got {bias.dtype} {list(bias.shape)}")
    if not 1 <= topk <= e or e > 4096:
        raise ValueError(f"gate_topk's topk must be in [1, {e}] for at most 4096 experts, got topk {topk} of {e}")
    if func not in FUNCS:
        raise ValueError(f"gate_topk's func must be one of {', '.join(FUNCS)}, got {func!r}")
    if not temp > 0:
        raise ValueError(f"gate_topk's temp must be positive, got {temp}")


def _top_k_consts(e: int, topk: int, func: str, temp: float, normalize: bool, scaling: float,
                  device: torch.device) -> dict:
    inv_temp = (torch.ones((), dtype=torch.float32) / temp).item()  # fp32(1 / fp32(temp)), as torch on the GPU
    # the interpreter (CPU tensors) has no libdevice; meta tensors are the AOT builder's, for the GPU
    return dict(E=e, TOPK=topk, FUNC=func, INV_TEMP=inv_temp, NORMALIZE=bool(normalize and topk > 1),
                SCALING=float(scaling), EXACT=device.type != "cpu")


def gate_topk(logits: torch.Tensor, bias: torch.Tensor, *, topk: int, func: str, temp: float, normalize: bool,
              scaling: float, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k experts of each row of logits fp32 [N, E] (+ bias fp32 [E]) and their weights: weights fp32 [N, k],
    experts int64 [N, k], as `dsl.ops.moe.gate_topk`."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        raise ValueError(f"gate_topk's logits must be contiguous float32 [N, E], got {logits.dtype} "
                         f"{list(logits.shape)}")
    n, e = logits.shape
    _check(e, bias, topk, func, temp)
    weights = torch.empty(n, topk, dtype=torch.float32, device=logits.device)
    experts = torch.empty(n, topk, dtype=torch.int64, device=logits.device)
    config = config or default_config(e)
    launch(gate_topk_kernel, (n,), (logits, bias, weights, experts),
           _top_k_consts(e, topk, func, temp, normalize, scaling, logits.device)
           | dict(block_E=triton.next_power_of_2(e), block_K=triton.next_power_of_2(topk)), config["num_warps"], 1)
    return weights, experts


def gate_one_row(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, *, topk: int, func: str, temp: float,
                 normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token's gate x [1, K] (fp32 or bf16) against fp32 weights w [E, K] (+ bias [E]) in one launch
    (`gate_one_row_kernel`): `gate_topk` over kernels/linear/linear.py's one-row projection (its `gemv_config` tiles),
    bit for bit. Returns weights fp32 [1, k] and experts int64 [1, k]."""
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"gate_one_row's x must be one contiguous float32/bfloat16 row [1, K], got {x.dtype} "
                         f"{list(x.shape)}")
    e, k = w.shape if w.dim() == 2 else (0, 0)
    if w.dtype != torch.float32 or not w.is_contiguous() or k != x.shape[1] or w.device != x.device:
        raise ValueError(f"gate_one_row's w must be contiguous float32 [E, {x.shape[1]}] on {x.device}, got "
                         f"{w.dtype} {list(w.shape)}")
    _check(e, bias, topk, func, temp)
    config = linear.gemv_config(e, k, w_bytes=4)
    split, block_n, block_k = config["split_k"], config["block_N"], config["block_K"]
    tiles = triton.cdiv(e, block_n)
    weights = torch.empty(1, topk, dtype=torch.float32, device=x.device)
    experts = torch.empty(1, topk, dtype=torch.int64, device=x.device)
    logits = torch.empty(e, dtype=torch.float32, device=x.device)
    ws = logits if split == 1 else torch.empty(split, e, dtype=torch.float32, device=x.device)
    launch(gate_one_row_kernel, (tiles, split),
           (x, w, ws, logits, tickets.tile_counters(x.device, tiles + 1), bias, weights, experts),
           _top_k_consts(e, topk, func, temp, normalize, scaling, x.device)
           | dict(K=k, SPLIT_K=split, K_PER_SPLIT=linear.k_per_split(k, split, block_k), block_N=block_n,
                  block_K=block_k, block_E=triton.next_power_of_2(e), block_TOPK=triton.next_power_of_2(topk)),
           config["num_warps"], config["num_stages"])
    return weights, experts


__all__ = ["FUNCS", "default_config", "gate_one_row", "gate_one_row_kernel", "gate_topk", "gate_topk_kernel"]
