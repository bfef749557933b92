"""Batch-invariant cpu implementations of the ops whose torch reference rounds differently with the batch.

A request's logits must be bitwise the same alone or in any batch, however its prompt is chunked. Measured on
this build (torch 2.13, MKL sgemm, AVX-512; tests/test_engine_batch_invariance.py re-checks every claim):
- a GEMM row's result is the same for every row count from 12 on and at 4 and 8 (wherever the row sits), and
  differs at 1 to 3, 5 to 7, 9 to 11 (a GEMV, and kernels for the remainder rows); a column's is the same for every
  column count from 12 on. So the linear layers run as W @ x^T with at least `MIN_COLS` token columns (which is also
  faster than `F.linear` at the head: 17 against 25 ms at 1 to 16 tokens), the GEMMs inside other ops get zero rows
  added up to a multiple of 4 below 12 (`padded_rows`), and GEMMs over a sequence's cache at least `MIN_COLS` keys;
- `bmm` gives each batch element the same result whatever the batch count;
- elementwise kernels round an element alike wherever it sits, except sigmoid, silu and softplus (and exp2), whose
  vector and scalar-tail paths differ: an element's bits depend on the tensor's size. Softmax over a dim other than
  the last does too, unless the inner size is a multiple of 64. Inside the ops that use them these are computed
  from exp, log1p, max, sum and division (`InvariantElementwise`), which agree on both paths;
- a sum over a middle dim rounds differently with the size of the inner dim, so the indexer's sum over heads is
  written as a sequential loop;
- attention reduces over every key of the softmax, so each query attends over exactly `window + index_topk` keys
  in a fixed order (window positions oldest first, then selected entries by index), masked where absent;
- top-k picks among equal scores depend on the row width, so selection is by stable sort: lowest index first.
Everything else in the model (norms, softmax over a fixed dim, reductions over a fixed inner dim, elementwise ops,
`hc_expand`'s bmm) was found invariant as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode

from dsl.ops import OPS
from dsl.ops.attention import CacheView
from dsl.ops.dense import weight_values
from dsl.ops.indexer import block_layout, mask_incomplete
from dsl.ragged import Ragged

ROW_QUANTUM, FREE_ROWS = 4, 12
MIN_COLS = 16


def padded_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs with: itself from FREE_ROWS on, else the next ROW_QUANTUM multiple."""
    return rows if rows >= FREE_ROWS else max(ROW_QUANTUM, -(-rows // ROW_QUANTUM) * ROW_QUANTUM)


def pad_rows(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x [n, ...] with zero rows appended up to `rows` (default: `padded_rows(n)`)."""
    rows = padded_rows(x.shape[0]) if rows is None else rows
    return x if x.shape[0] >= rows else torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1 / (1 + torch.exp(-x))


def _silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    return torch.where(x * beta > threshold, x, torch.log1p(torch.exp(x * beta)) / beta)


def _sum(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`sum`; on a GPU over one dim, in a fixed order: a tree of elementwise adds (zeros padding the dim to a power
    of two add exactly). CUDA's reduction kernels split a row's sum by how many rows there are, so a row's bits
    would follow the batch; the CPU's reductions over the last dim were found invariant as they are."""
    if x.device.type == "cpu" or not isinstance(dim, int):
        return torch.sum(x, dim, keepdim, dtype=dtype) if dim is not None else torch.sum(x, dtype=dtype)
    x = (x if dtype is None else x.to(dtype)).movedim(dim, -1)
    width = 1 << max(0, x.shape[-1] - 1).bit_length()
    x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x.movedim(-1, dim) if keepdim else x.squeeze(-1)


def _mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`mean` through `_sum`."""
    if x.device.type == "cpu" or not isinstance(dim, int):
        return torch.mean(x, dim, keepdim, dtype=dtype) if dim is not None else torch.mean(x, dtype=dtype)
    return _sum(x, dim, keepdim, dtype=dtype) / x.shape[dim]


def _softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None, **kwargs) -> torch.Tensor:
    x = x if dtype is None else x.to(dtype)
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / _sum(e, dim, keepdim=True)


class InvariantElementwise(TorchFunctionMode):
    """Within it, sigmoid, silu, softplus and softmax are computed from functions whose bits do not depend on the
    tensor's size, and on a GPU sums and means over a dim in a fixed order (`_sum`)."""

    REPLACEMENTS: ClassVar[dict[Callable, Callable]] = {
        torch.sigmoid: _sigmoid, torch.Tensor.sigmoid: _sigmoid, torch.nn.functional.silu: _silu,
        torch.nn.functional.softplus: _softplus, torch.softmax: _softmax, torch.Tensor.softmax: _softmax,
        torch.nn.functional.softmax: _softmax, torch.sum: _sum, torch.Tensor.sum: _sum, torch.mean: _mean,
        torch.Tensor.mean: _mean,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.REPLACEMENTS.get(func, func)(*args, **(kwargs or {}))


def _invariant(name: str, pad: bool = True) -> Callable:
    """The reference of op `name` under InvariantElementwise, on its first input padded by `pad_rows` (when `pad`);
    outputs cut back to the real rows."""
    reference = OPS[name].reference

    def run(x, *args, **kwargs):
        if isinstance(x, Ragged):
            return x.replace(run(x.values, *args, **kwargs))
        with InvariantElementwise():
            out = reference(pad_rows(x) if pad else x, *args, **kwargs)
        if not pad:
            return out
        return tuple(o[: x.shape[0]] for o in out) if isinstance(out, tuple) else out[: x.shape[0]]

    return run


def linear(x, w: torch.Tensor, scale: torch.Tensor | None = None):
    """`linear` as W @ x^T over at least MIN_COLS tokens: x [..., I] (or Ragged) -> fp32 [..., O]."""
    if isinstance(x, Ragged):
        return x.replace(linear(x.values, w, scale))
    rows = x.reshape(-1, x.shape[-1]).float()  # [R, I]
    out = torch.mm(weight_values(w, scale), pad_rows(rows, max(MIN_COLS, rows.shape[0])).t())  # [O, >= R]
    return out[:, : rows.shape[0]].t().contiguous().reshape(*x.shape[:-1], w.shape[0])


def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int, eps: float,
             norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_mixes` with its projection as `linear` above and the invariant sigmoid. Written out rather than run under
    InvariantElementwise: the Sinkhorn loop's many small calls would each pay the mode's dispatch."""
    hc = h.shape[1]
    flat = h.reshape(h.shape[0], -1).float()  # [N, hc * D]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = linear(flat, fn.float())  # [N, (2 + hc) * hc]
    scale, base = scale.float(), base.float()
    pre = _sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * _sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = torch.softmax((m[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(-1, hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
            weight: torch.Tensor | None = None) -> torch.Tensor:
    """dsl.ops.moe.swiglu_expert with `linear` above and the invariant silu."""
    gate, up = linear(x, w1), linear(x, w3)
    if limit > 0:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    inner = _silu(gate) * up
    return linear(inner if weight is None else weight * inner, w2)


def swiglu(x: torch.Tensor, w1, w2, w3, s1=None, s2=None, s3=None, *, limit: float) -> torch.Tensor:
    """`swiglu` (the shared expert) through `_swiglu`."""
    return _swiglu(x.float(), weight_values(w1, s1), weight_values(w2, s2), weight_values(w3, s3), limit)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1, w2, w3, s1=None, s2=None, s3=None,
                *, limit: float) -> torch.Tensor:
    """`moe_experts` through `_swiglu`: an expert sees 1 to N rows as the batch goes, each row alike."""
    x = x.float()
    y = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        w = [weight_values(m[e], None if s is None else s[e]) for m, s in ((w1, s1), (w2, s2), (w3, s3))]
        y[rows] += _swiglu(x[rows], *w, limit, weights[rows, slot, None])
    return y


def sparse_attention(q: torch.Tensor, window: CacheView, sink: torch.Tensor, compressed: CacheView | None = None,
                     topk: torch.Tensor | None = None, *, window_size: int, scale: float, causal: bool = True,
                     ctx) -> torch.Tensor:
    """`sparse_attention` with every query over the same number of keys in a fixed order (see the module).

    Causal: a query's keys are the `window_size` positions up to its own, oldest first (masked before the view's
    first position: 0, or where bounded replay cuts the window), then its `topk` picks (masked where -1), so every
    query of the forward has as many keys and all of them go through one `bmm` (which rounds each batch element
    alike whatever the batch). A draft block (not causal)
    attends to its sequence's whole view, whose length depends on the sequence alone: blocks of equal view length
    share a `bmm`.
    """
    n, dev = q.shape[0], q.device
    out = torch.empty(q.shape, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    lengths = torch.tensor([c.length for c in ctx.chunks], device=dev)
    pool = window.flat().float().to(dev)  # every chunk's view, chunk after chunk
    sizes = torch.tensor(window.lengths, device=dev)
    offset = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, lengths)  # [N]: each query's view in the pool
    if not causal:
        for size in sorted(set(window.lengths)):
            rows = torch.cat([torch.arange(c.start, c.start + c.length, device=dev)
                              for c, length in zip(ctx.chunks, window.lengths, strict=True) if length == size])
            index = offset[rows, None] + torch.arange(size, device=dev)
            out[rows] = _attend(q[rows], pool[index], torch.ones(index.shape, dtype=torch.bool, device=dev), sink,
                                scale)
        return out
    first = torch.repeat_interleave(torch.tensor(window.first, device=dev), lengths)
    wanted = ctx.positions.to(dev)[:, None] - window_size + 1 + torch.arange(window_size, device=dev)  # [N, W]
    index = offset[:, None] + (wanted - first[:, None]).clamp(min=0)  # [N, W] rows of the pool
    mask = wanted >= first[:, None]
    picked = None
    if compressed is not None and topk is not None:  # only the picked entries are read
        picks = topk.to(dev)
        present = (picks >= 0) & (torch.tensor(compressed.lengths, device=dev)[ctx.row_chunks.to(dev), None] > 0)
        picked = torch.zeros(*picks.shape, pool.shape[-1], device=dev)  # absent picks: zero keys, masked
        if bool(present.any()):
            run = ctx.row_chunks.to(dev)[:, None].expand_as(picks)
            picked[present] = compressed.rows(run[present], picks[present]).float().to(dev)
        mask = torch.cat([mask, picks >= 0], dim=1)
    for start in range(0, n, ATTENTION_ROWS):  # keys gathered a block of queries at a time: bounded memory
        rows = slice(start, min(n, start + ATTENTION_ROWS))
        keys = pool[index[rows]]  # [T, W, D]
        if picked is not None:
            keys = torch.cat([keys, picked[rows]], dim=1)  # [T, W + K, D]
        out[rows] = _attend(q[rows], keys, mask[rows], sink, scale)
    return out


ATTENTION_ROWS = 1024


def _attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Attention of queries q [T, H, D] each over its own keys [T, S, D] (mask [T, S]) with the sink logit per head
    in the denominator: fp32 [T, H, D]."""
    logits = torch.bmm(q.float(), keys.transpose(1, 2)) * scale  # [T, H, S]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    full = torch.cat([logits, sink.float()[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    probs = _softmax(full, dim=-1)[..., :-1]
    return torch.bmm(probs, keys)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: CacheView, *, ratio: int, ctx) -> torch.Tensor:
    """`index_scores` with at least MIN_COLS keys per GEMM and the sum over heads in a fixed order."""
    width = max((k.shape[0] for k in keys.keys), default=0)
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    heads, dim = q.shape[1], q.shape[2]
    for i, c in enumerate(ctx.chunks):
        k = keys.keys[i].float()  # [L, d]
        if k.shape[0] == 0:
            continue
        # One GEMM of (token, head) rows by keys: rows padded as for a linear, at least MIN_COLS keys.
        qc = pad_rows(q[c.rows].float(), _padded_tokens(c.length, heads))
        s = torch.einsum("thd,ld->thl", qc, pad_rows(k, MIN_COLS))[: c.length, :, : k.shape[0]].relu_() * dim**-0.5
        w = weights[c.rows].float() * heads**-0.5  # [T, H]
        scores = s[:, 0] * w[:, :1]
        for h in range(1, heads):
            scores = scores + s[:, h] * w[:, h : h + 1]
        out[c.rows, : k.shape[0]] = mask_incomplete(scores, ctx.positions[c.rows], ratio)
    return out


def _padded_tokens(tokens: int, heads: int) -> int:
    """The fewest tokens >= `tokens` whose rows of (token, head) make a row count `padded_rows` leaves alone."""
    while padded_rows(tokens * heads) != tokens * heads:
        tokens += 1
    return tokens


def _stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [N, k] of the k highest scores per row, equal scores lowest index first (rows padded with -inf)."""
    if scores.shape[-1] < k:
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[-1]), value=float("-inf"))
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def candidate_blocks(scores: torch.Tensor, *, ratio: int, block: int, topk_blocks: int, ctx) -> torch.Tensor:
    """`candidate_blocks` with ties among block maxima broken by the lowest block index."""
    width = scores.shape[-1]
    padded = scores if width % block == 0 else torch.nn.functional.pad(scores, (0, -width % block),
                                                                        value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(dim=-1)  # [N, B]
    newest, columns = ctx.memo(("blocks", ratio, block, blocks.shape[-1], width),
                               lambda: block_layout(ctx.positions, ratio, block, blocks.shape[-1], width))
    blocks = blocks.masked_fill(newest, float("inf"))
    top = _stable_top(blocks, topk_blocks)[:, : blocks.shape[-1]]
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > float("-inf"))
    return keep[:, columns]


def topk_select(scores: torch.Tensor, candidates: torch.Tensor | None = None, *, topk: int) -> torch.Tensor:
    """`topk_select` always `topk` wide, ties to the lowest index, picks in ascending order and -1 last."""
    if candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    top = _stable_top(scores, topk)  # [N, topk]
    finite = torch.nn.functional.pad(scores, (0, max(0, topk - scores.shape[-1])), value=float("-inf"))
    picks = torch.where(finite.gather(-1, top) > float("-inf"), top, torch.full_like(top, -1))
    return _ascending(picks)


def _ascending(picks: torch.Tensor) -> torch.Tensor:
    """Picks [N, K] sorted ascending with every -1 after the picks."""
    big = torch.iinfo(torch.long).max
    ordered = torch.where(picks >= 0, picks, big).sort(dim=-1).values
    return torch.where(ordered == big, -1, ordered)


KERNELS: dict[str, Callable] = {
    "linear": linear,
    "hc_mixes": hc_mixes,
    "swiglu": swiglu,
    "moe_experts": moe_experts,
    **{name: _invariant(name) for name in ("grouped_linear", "moe_gate")},
    **{name: _invariant(name, pad=False) for name in ("engram_gate", "compress_pool")},
    "sparse_attention": sparse_attention,
    "index_scores": index_scores,
    "candidate_blocks": candidate_blocks,
    "topk_select": topk_select,
}
