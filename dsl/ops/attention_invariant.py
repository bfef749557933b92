"""The batch-invariant reference of `sparse_attention`: every query over the same number of keys in a fixed order.

Attention reduces over every key of its softmax, so a query's sum must not follow how many keys its neighbours have:
causal, a query's keys are the `window_size` positions up to its own, oldest first (masked before the view's first
position: 0, or where bounded replay cuts the window), then its `topk` picks (masked where -1), so every query of the
forward has `window + index_topk` keys and all of them go through one `bmm` (which rounds each batch element alike
whatever the batch). A draft block (not causal) attends to its sequence's whole view, whose length depends on the
sequence alone: blocks of equal view length share a `bmm`.
"""

from __future__ import annotations

import torch

from dsl.ops.attention import CacheView
from dsl.ops.invariant import softmax
from dsl.ops.registry import invariant

ATTENTION_ROWS = 1024  # queries whose keys are gathered at once: bounded memory


@invariant("sparse_attention")
def invariant_sparse_attention(q: torch.Tensor, window: CacheView, sink: torch.Tensor,
                               compressed: CacheView | None = None, topk: torch.Tensor | None = None, *,
                               window_size: int, scale: float, causal: bool = True, ctx) -> torch.Tensor:
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
    for start in range(0, n, ATTENTION_ROWS):
        rows = slice(start, min(n, start + ATTENTION_ROWS))
        keys = pool[index[rows]]  # [T, W, D]
        if picked is not None:
            keys = torch.cat([keys, picked[rows]], dim=1)  # [T, W + K, D]
        out[rows] = _attend(q[rows], keys, mask[rows], sink, scale)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Attention of queries q [T, H, D] each over its own keys [T, S, D] (mask [T, S]) with the sink logit per head
    in the denominator: fp32 [T, H, D]."""
    logits = torch.bmm(q.float(), keys.transpose(1, 2)) * scale  # [T, H, S]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    full = torch.cat([logits, sink.float()[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    probs = softmax(full, dim=-1)[..., :-1]
    return torch.bmm(probs, keys)


__all__ = ["ATTENTION_ROWS", "invariant_sparse_attention"]
