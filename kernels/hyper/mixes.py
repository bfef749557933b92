"""Hyper-connections' mixes: the RMS-normalised projection of the flattened streams, then Sinkhorn.

`hc_mixes` is a reduction over hc*D = 20480 values per token against a [24, 20480] projection (padded to 32 rows,
multiplied as tf32x3 on the tensor cores: fp32 FMA products in `tl.dot` are many times slower): for a handful of
decode tokens that is too little work for one program per token, so K is split into fixed ranges (partial
products and sums of squares to a workspace) and a second kernel sums them in order, scales by the row's
rsqrt, and runs the sigmoids, the row softmax and Sinkhorn on a 4 x 4 tile in registers. One token (a batch-1 decode
step) runs both in one launch, `hc_mixes_kernel`: the last program of the split to finish (a ticket,
kernels/tickets.py) runs the second kernel's work, with its bits. Where the mixes read the streams a stream update
has just made, the update runs inside their first launch (`hc_update_mixes`): each program makes its tile of the new
streams, stores it and projects it, so the update has no launch of its own.
"""

from __future__ import annotations

import torch

from kernels import tickets
from kernels.hyper.hyper import _bf16_sum, _check_expand, _check_streams
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.tickets import last_arrival


@triton.jit
def _streams_tile(h_ptr, a_ptr, b_ptr, post_ptr, comb_ptr, new_ptr, offs_m, ks, mask, UPDATE: tl.constexpr,
                  ROUND_BF16: tl.constexpr, HC: tl.constexpr, D: tl.constexpr, KTOT: tl.constexpr):
    """The flattened streams' tile [block_M, block_K] at rows `offs_m`, columns `ks` (k * D + d): read from h
    (UPDATE 0), or made by the update before the mixes from the old streams h, its post and comb and the sub-layer's
    output y (UPDATE 1: y = a; 2: y = a + b as hyper.py's `hc_add_expand_kernel` sums them), as hyper.py's `_expand`
    makes them, and stored to new_ptr."""
    rows = offs_m[:, None].to(tl.int64)
    if UPDATE == 0:
        x = tl.load(h_ptr + rows * KTOT + ks[None, :], mask=mask, other=0.0)
    else:
        k, d = (ks // D)[None, :], (ks % D)[None, :]
        y = tl.load(a_ptr + rows * D + d, mask=mask, other=0.0).to(tl.float32)
        if UPDATE == 2:
            y = y + tl.load(b_ptr + rows * D + d, mask=mask, other=0.0).to(tl.float32)
            if ROUND_BF16:
                y = y.to(tl.bfloat16).to(tl.float32)
        x = tl.load(post_ptr + rows * HC + k, mask=mask, other=0.0) * y
        for j in tl.static_range(HC):
            hj = tl.load(h_ptr + (rows * HC + j) * D + d, mask=mask, other=0.0)
            x = tl.fma(tl.load(comb_ptr + (rows * HC + j) * HC + k, mask=mask, other=0.0), hj, x)
        tl.store(new_ptr + rows * KTOT + ks[None, :], x, mask=mask)
    return x


@triton.jit
def _partial(h_ptr, fn_ptr, ws_ptr, ss_ptr, M, pid_m, split, a_ptr, b_ptr, post_ptr, comb_ptr, new_ptr,
             UPDATE: tl.constexpr, ROUND_BF16: tl.constexpr, HC: tl.constexpr, D: tl.constexpr, KTOT: tl.constexpr,
             NOUT: tl.constexpr, K_PER_SPLIT: tl.constexpr, block_O: tl.constexpr, block_M: tl.constexpr,
             block_K: tl.constexpr):
    """Row tile `pid_m`'s products with the projection and sums of squares over K range `split` of the streams
    (`_streams_tile`), stored to the workspace (ws [split, M, block_O], ss [split, M])."""
    offs_m = pid_m * block_M + tl.arange(0, block_M)
    offs_o = tl.arange(0, block_O)
    offs_k = tl.arange(0, block_K)
    mask_m = offs_m < M
    acc = tl.zeros([block_M, block_O], dtype=tl.float32)
    ss = tl.zeros([block_M], dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, block_K):
        ks = split * K_PER_SPLIT + k0 + offs_k
        mask_k = ks < KTOT
        x = _streams_tile(h_ptr, a_ptr, b_ptr, post_ptr, comb_ptr, new_ptr, offs_m, ks,
                          mask_m[:, None] & mask_k[None, :], UPDATE, ROUND_BF16, HC, D, KTOT)  # [block_M, block_K]
        f = tl.load(fn_ptr + offs_o[:, None] * KTOT + ks[None, :], mask=(offs_o[:, None] < NOUT) & mask_k[None, :],
                    other=0.0)  # [block_O, block_K], rows of fn read along K
        # three tf32 products (hi*hi + hi*lo + lo*hi) on the tensor cores: fp32 accuracy, which Sinkhorn needs
        acc = tl.dot(x, tl.trans(f), acc, input_precision="tf32x3")
        ss += tl.sum(x * x, axis=1)
    ws = ws_ptr + split * M * block_O
    tl.store(ws + offs_m[:, None] * block_O + offs_o[None, :], acc, mask=mask_m[:, None])
    tl.store(ss_ptr + split * M + offs_m, ss, mask=mask_m)


@triton.jit
def _finish(ws_ptr, ss_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, row, M, HC: tl.constexpr,
            KTOT: tl.constexpr, SPLIT_K: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr,
            NORM_EPS: tl.constexpr, block_O: tl.constexpr):
    """Row `row`'s mixes from the workspace: its splits summed in split order (read from L2, .cg, where another
    program's stores may have gone), scaled by the streams' rsqrt, then the sigmoids and Sinkhorn on the hc x hc
    tile."""
    i = tl.arange(0, HC)
    jk = tl.arange(0, HC)[:, None] * HC + tl.arange(0, HC)[None, :]  # comb[j, k] = m[2*HC + j*HC + k]
    ss = 0.0
    m_pre = tl.zeros([HC], dtype=tl.float32)
    m_post = tl.zeros([HC], dtype=tl.float32)
    m_comb = tl.zeros([HC, HC], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ws = ws_ptr + (s * M + row) * block_O
        ss += tl.load(ss_ptr + s * M + row, cache_modifier=".cg")
        m_pre += tl.load(ws + i, cache_modifier=".cg")
        m_post += tl.load(ws + HC + i, cache_modifier=".cg")
        m_comb += tl.load(ws + 2 * HC + jk, cache_modifier=".cg")
    r = tl.rsqrt(ss / KTOT + NORM_EPS)  # the flattened streams' RMS norm, applied after the projection
    pre = tl.sigmoid(m_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + i)) + EPS
    post = 2.0 * tl.sigmoid(m_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + i))
    c = m_comb * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * HC + jk)
    c = tl.exp(c - tl.max(c, axis=1)[:, None])
    c = c / tl.sum(c, axis=1)[:, None] + EPS
    c = c / (tl.sum(c, axis=0)[None, :] + EPS)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=1)[:, None] + EPS)
        c = c / (tl.sum(c, axis=0)[None, :] + EPS)
    tl.store(pre_ptr + row * HC + i, pre)
    tl.store(post_ptr + row * HC + i, post)
    tl.store(comb_ptr + row * HC * HC + jk, c)


@triton.jit
def _finish_tile(ws_ptr, ss_ptr, count_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, pid_m, M,
                 HC: tl.constexpr, KTOT: tl.constexpr, SPLIT_K: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr,
                 NORM_EPS: tl.constexpr, block_O: tl.constexpr, block_M: tl.constexpr):
    """In the last of row tile `pid_m`'s SPLIT_K programs to take a ticket: `_finish` for each of the tile's rows."""
    if last_arrival(count_ptr, pid_m, SPLIT_K):
        for row in range(pid_m * block_M, tl.minimum(pid_m * block_M + block_M, M)):
            _finish(ws_ptr, ss_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, row, M, HC, KTOT, SPLIT_K, ITERS,
                    EPS, NORM_EPS, block_O)
        tl.atomic_xchg(count_ptr + pid_m, 0, sem="relaxed", scope="gpu")  # zero again for the next launch


@triton.jit(do_not_specialize=["M"])
def hc_mixes_partial_kernel(h_ptr, fn_ptr, ws_ptr, ss_ptr, M, KTOT: tl.constexpr, NOUT: tl.constexpr,
                            K_PER_SPLIT: tl.constexpr, block_O: tl.constexpr, block_M: tl.constexpr,
                            block_K: tl.constexpr):
    pdl_prologue()
    _partial(h_ptr, fn_ptr, ws_ptr, ss_ptr, M, tl.program_id(0), tl.program_id(1), h_ptr, h_ptr, h_ptr, h_ptr, h_ptr,
             0, False, 1, KTOT, KTOT, NOUT, K_PER_SPLIT, block_O, block_M, block_K)


@triton.jit(do_not_specialize=["M"])
def hc_mixes_finish_kernel(ws_ptr, ss_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, M,
                           HC: tl.constexpr, KTOT: tl.constexpr, SPLIT_K: tl.constexpr, ITERS: tl.constexpr,
                           EPS: tl.constexpr, NORM_EPS: tl.constexpr, block_O: tl.constexpr):
    pdl_prologue()
    _finish(ws_ptr, ss_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, tl.program_id(0), M, HC, KTOT, SPLIT_K,
            ITERS, EPS, NORM_EPS, block_O)


@triton.jit(do_not_specialize=["M"])
def hc_mixes_kernel(h_ptr, fn_ptr, ws_ptr, ss_ptr, count_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, M,
                    HC: tl.constexpr, KTOT: tl.constexpr, NOUT: tl.constexpr, SPLIT_K: tl.constexpr,
                    K_PER_SPLIT: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr, NORM_EPS: tl.constexpr,
                    block_O: tl.constexpr, block_M: tl.constexpr, block_K: tl.constexpr):
    """The two kernels above in one launch: each program stores its partial, and the last of a row tile's SPLIT_K
    programs to take a ticket (kernels/tickets.py) finishes the tile's rows one after another; their bits."""
    pdl_prologue()
    pid_m = tl.program_id(0)
    _partial(h_ptr, fn_ptr, ws_ptr, ss_ptr, M, pid_m, tl.program_id(1), h_ptr, h_ptr, h_ptr, h_ptr, h_ptr, 0, False,
             1, KTOT, KTOT, NOUT, K_PER_SPLIT, block_O, block_M, block_K)
    _finish_tile(ws_ptr, ss_ptr, count_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, pid_m, M, HC, KTOT,
                 SPLIT_K, ITERS, EPS, NORM_EPS, block_O, block_M)


@triton.jit(do_not_specialize=["M"])
def hc_update_mixes_partial_kernel(a_ptr, b_ptr, h_ptr, upd_post_ptr, upd_comb_ptr, new_ptr, fn_ptr, ws_ptr, ss_ptr,
                                   M, UPDATE: tl.constexpr, ROUND_BF16: tl.constexpr, HC: tl.constexpr,
                                   D: tl.constexpr, NOUT: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                                   block_O: tl.constexpr, block_M: tl.constexpr, block_K: tl.constexpr):
    """`hc_mixes_partial_kernel` over the streams the update before the mixes makes (`_streams_tile`, UPDATE 1 or 2),
    which it stores: the stream update's launch and the partial one in one."""
    pdl_prologue()
    _partial(h_ptr, fn_ptr, ws_ptr, ss_ptr, M, tl.program_id(0), tl.program_id(1), a_ptr, b_ptr, upd_post_ptr,
             upd_comb_ptr, new_ptr, UPDATE, ROUND_BF16, HC, D, HC * D, NOUT, K_PER_SPLIT, block_O, block_M, block_K)


@triton.jit(do_not_specialize=["M"])
def hc_update_mixes_kernel(a_ptr, b_ptr, h_ptr, upd_post_ptr, upd_comb_ptr, new_ptr, fn_ptr, ws_ptr, ss_ptr,
                           count_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, M, UPDATE: tl.constexpr,
                           ROUND_BF16: tl.constexpr, HC: tl.constexpr, D: tl.constexpr, NOUT: tl.constexpr,
                           SPLIT_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, ITERS: tl.constexpr, EPS: tl.constexpr,
                           NORM_EPS: tl.constexpr, block_O: tl.constexpr, block_M: tl.constexpr,
                           block_K: tl.constexpr):
    """`hc_update_mixes_partial_kernel` with the finish in the split's last program, as `hc_mixes_kernel`."""
    pdl_prologue()
    pid_m = tl.program_id(0)
    _partial(h_ptr, fn_ptr, ws_ptr, ss_ptr, M, pid_m, tl.program_id(1), a_ptr, b_ptr, upd_post_ptr, upd_comb_ptr,
             new_ptr, UPDATE, ROUND_BF16, HC, D, HC * D, NOUT, K_PER_SPLIT, block_O, block_M, block_K)
    _finish_tile(ws_ptr, ss_ptr, count_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, pid_m, M, HC, HC * D,
                 SPLIT_K, ITERS, EPS, NORM_EPS, block_O, block_M)


ONE_LAUNCH_ROWS = 1  # up to this many tokens the mixes run as one launch (`hc_mixes_kernel`), its last program
# finishing the rows one by one; more rows finish one program a row in a second launch


def one_launch(tokens: int, config: dict) -> bool:
    """Whether `hc_mixes` runs `tokens` tokens as one launch under `config`: up to `ONE_LAUNCH_ROWS`, unless the config
    launches the same kernels at every count (`one_launch` False: batch-invariant configs, graphs/plan.py)."""
    return tokens <= ONE_LAUNCH_ROWS and config.get("one_launch", True)


def mixes_config(m: int, ktot: int, num_sms: int = 132) -> dict:
    # many tokens: 64 per program, so the [32, hc*D] projection is re-read from L2 4x less
    block_m, block_k = (16, 64) if m <= 64 else (64, 64)  # tf32x3 keeps three operand splits live: 256 spills
    tiles = triton.cdiv(m, block_m)
    split = 1
    while tiles * split < num_sms and ktot // (split * 2) >= 4 * block_k and split < 64:
        split *= 2
    return {"block_M": block_m, "block_K": block_k, "split_k": split, "num_warps": 4 if m <= 64 else 8,
            "num_stages": 3}


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int, eps: float,
             norm_eps: float, config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre [N, hc], post [N, hc], comb [N, hc, hc] (fp32) from streams h [N, hc, D] (contiguous fp32).

    fn [(2 + hc) * hc, hc * D], scale [3], base [(2 + hc) * hc], all fp32 and contiguous.
    """
    _check_streams(h, "hc_mixes")
    return _mixes(h, fn, scale, base, None, iters=iters, eps=eps, norm_eps=norm_eps, config=config, what="hc_mixes")


def hc_update_mixes(a: torch.Tensor, b: torch.Tensor | None, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                    fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int, eps: float,
                    norm_eps: float, config: dict | None = None) -> tuple[torch.Tensor, ...]:
    """The stream update, then the mixes of the streams it makes, the update inside the mixes' first launch (no
    launch of its own): `hc_expand(a, h, post, comb)` (b None) or `hc_add_expand(a, b, h, post, comb)`, then
    `hc_mixes` of the result, with the bits of those launches. Returns the new streams fp32 [N, hc, D] and their
    pre, post and comb."""
    _check_expand({"a": a} if b is None else {"a": a, "b": b}, h, post, comb, "hc_update_mixes")
    new = torch.empty_like(h)
    return (new, *_mixes(h, fn, scale, base, (a, b, post, comb, new), iters=iters, eps=eps, norm_eps=norm_eps,
                         config=config, what="hc_update_mixes"))


def _mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, update: tuple | None, *,
           iters: int, eps: float, norm_eps: float, config: dict | None,
           what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixes' launches over streams h, or (`update`: a, b or None, the update's post and comb, the new streams'
    tensor) over the streams the update makes from h."""
    n, hc, d = h.shape
    nout, ktot = (2 + hc) * hc, hc * d
    for t, shape in ((fn, (nout, ktot)), (scale, (3,)), (base, (nout,))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{what} needs contiguous float32 {list(shape)}, got {t.dtype} {list(t.shape)}")
    config = config or mixes_config(max(n, 1), ktot)
    pre = torch.empty(n, hc, dtype=torch.float32, device=h.device)
    post = torch.empty(n, hc, dtype=torch.float32, device=h.device)
    comb = torch.empty(n, hc, hc, dtype=torch.float32, device=h.device)
    if n == 0:
        return pre, post, comb
    split, block_k, block_o = config["split_k"], config["block_K"], max(16, triton.next_power_of_2(nout))
    k_per_split = triton.cdiv(triton.cdiv(ktot, split), block_k) * block_k
    ws = torch.empty(split, n, block_o, dtype=torch.float32, device=h.device)
    ss = torch.empty(split, n, dtype=torch.float32, device=h.device)
    tiles = triton.cdiv(n, config["block_M"])
    tiling = dict(NOUT=nout, K_PER_SPLIT=k_per_split, block_O=block_o, block_M=config["block_M"], block_K=block_k)
    sinkhorn = dict(SPLIT_K=split, ITERS=iters, EPS=eps, NORM_EPS=norm_eps)
    if update is None:
        streams, shape, one = (h,), dict(KTOT=ktot), dict(HC=hc)
        partial_kernel, one_kernel = hc_mixes_partial_kernel, hc_mixes_kernel
    else:
        a, b, upd_post, upd_comb, new = update
        streams, one = (a, a if b is None else b, h, upd_post, upd_comb, new), {}
        shape = dict(UPDATE=1 if b is None else 2, ROUND_BF16=_bf16_sum(a, b), HC=hc, D=d)
        partial_kernel, one_kernel = hc_update_mixes_partial_kernel, hc_update_mixes_kernel
    if one_launch(n, config):
        launch(one_kernel, (tiles, split),
               (*streams, fn, ws, ss, tickets.tile_counters(h.device, tiles), scale, base, pre, post, comb, n),
               shape | tiling | sinkhorn | one, config["num_warps"], config["num_stages"])
        return pre, post, comb
    launch(partial_kernel, (tiles, split), (*streams, fn, ws, ss, n), shape | tiling, config["num_warps"],
           config["num_stages"])
    launch(hc_mixes_finish_kernel, (n,), (ws, ss, scale, base, pre, post, comb, n),
           dict(HC=hc, KTOT=ktot, block_O=block_o) | sinkhorn, 1, 1)
    return pre, post, comb


__all__ = ["ONE_LAUNCH_ROWS", "hc_mixes", "hc_update_mixes", "mixes_config", "one_launch"]
