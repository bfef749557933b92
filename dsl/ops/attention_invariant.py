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

from dsl.context import cast
from dsl.ops.cache_view import CacheView
from dsl.ops.invariant import softmax
from dsl.ops.registry import invariant
from dsl.scalar import f32

ATTENTION_ROWS = 1024  # queries whose keys are gathered at once: bounded memory


@invariant("sparse_attention")
def invariant_sparse_attention(q: torch.Tensor, window: CacheView, sink: torch.Tensor,
                               compressed: CacheView | None = None, topk: torch.Tensor | None = None, *,
                               window_size: int, scale: float, causal: bool = True, ctx) -> torch.Tensor:
    n, dev = q.shape[0], q.device
    if n == 0:
        return torch.empty(q.shape, dtype=torch.float32, device=dev)
    pool = cast(window.flat(), torch.float32, dev)  # every chunk's view, chunk after chunk
    if not causal:
        return _attend_whole_views(q, window, pool, sink, scale, ctx)
    index, mask = ctx.memo(("invariant window", window_size, tuple(window.lengths), tuple(window.first)),
                           lambda: _window_layout(window, window_size, ctx, dev))
    picked = None
    if compressed is not None and topk is not None:  # only the picked entries are read
        picks = cast(topk, device=dev)  # [N, K]
        run, has_entries = ctx.memo(("invariant picks", picks.shape[1], tuple(compressed.lengths)),
                                    lambda: _pick_layout(compressed, picks.shape[1], ctx, dev))
        chosen = picks >= 0
        present = chosen if has_entries is None else chosen & has_entries
        if any(compressed.lengths):
            rows = compressed.rows(run, picks.clamp(min=0).reshape(-1)).reshape(*picks.shape, -1)
            picked = torch.where(present[..., None], cast(rows, torch.float32, dev), 0.0)  # absent: zero keys, masked
        else:
            picked = pool.new_zeros(*picks.shape, pool.shape[-1])
        mask = torch.cat([mask, chosen], dim=1)
    if n <= ATTENTION_ROWS:
        keys = pool[index] if picked is None else torch.cat([pool[index], picked], dim=1)  # [N, W (+ K), D]
        return _attend(q, keys, mask, sink, scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=dev)
    for start in range(0, n, ATTENTION_ROWS):
        rows = slice(start, min(n, start + ATTENTION_ROWS))
        keys = pool[index[rows]]  # [T, W, D]
        if picked is not None:
            keys = torch.cat([keys, picked[rows]], dim=1)  # [T, W + K, D]
        out[rows] = _attend(q[rows], keys, mask[rows], sink, scale)
    return out


def _window_layout(window: CacheView, window_size: int, ctx, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query [N, window_size]: the rows of the view's pool holding the positions up to its own, oldest first
    (clamped to the view's first where the window reaches before it), and which of them are present."""
    lengths = torch.tensor(ctx.lengths, device=dev)
    sizes = torch.tensor(window.lengths, device=dev)
    offset = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, lengths)  # [N]: each query's view in the pool
    first = torch.repeat_interleave(torch.tensor(window.first, device=dev), lengths)
    wanted = cast(ctx.positions, device=dev)[:, None] - window_size + 1 + torch.arange(window_size, device=dev)
    return offset[:, None] + (wanted - first[:, None]).clamp(min=0), wanted >= first[:, None]


def _pick_layout(compressed: CacheView, picks: int, ctx, dev: torch.device) -> tuple[torch.Tensor,
                                                                                    torch.Tensor | None]:
    """For `picks` picks per query: each pick's chunk [N * picks], and whether the query's chunk has entries [N, 1]
    (None where every chunk has)."""
    run = cast(ctx.row_chunks, device=dev)
    has_entries = None
    if not all(compressed.lengths):
        has_entries = (torch.tensor(compressed.lengths, device=dev)[run] > 0)[:, None]
    return run[:, None].expand(-1, picks).reshape(-1), has_entries


def _attend_whole_views(q: torch.Tensor, window: CacheView, pool: torch.Tensor, sink: torch.Tensor, scale: float,
                        ctx) -> torch.Tensor:
    """Not causal (a draft block): every query over its chunk's whole view; blocks of equal view length share a
    `bmm`."""
    dev = q.device
    out = torch.empty(q.shape, dtype=torch.float32, device=dev)
    lengths = torch.tensor(ctx.lengths, device=dev)
    sizes = torch.tensor(window.lengths, device=dev)
    offset = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, lengths)  # [N]: each query's view in the pool
    for size in sorted(set(window.lengths)):
        rows = torch.cat([torch.arange(c.start, c.start + c.length, device=dev)
                          for c, length in zip(ctx.chunks, window.lengths, strict=True) if length == size])
        index = offset[rows, None] + torch.arange(size, device=dev)
        out[rows] = _attend(q[rows], pool[index], torch.ones(index.shape, dtype=torch.bool, device=dev), sink, scale)
    return out


def _attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Attention of queries q [T, H, D] each over its own keys [T, S, D] (mask [T, S]) with the sink logit per head
    in the denominator: fp32 [T, H, D]."""
    logits = torch.bmm(cast(q, torch.float32), keys.transpose(1, 2)) * f32(scale)  # [T, H, S]
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    full = torch.cat([logits, cast(sink, torch.float32).view(1, -1, 1).expand(q.shape[0], -1, 1)], dim=-1)
    probs = softmax(full, dim=-1)[..., :-1]
    return torch.bmm(probs, keys)


__all__ = ["ATTENTION_ROWS", "invariant_sparse_attention"]
