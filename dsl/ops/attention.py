"""Sliding-window caches and sparse attention with a sink over window plus selected compressed entries.

The cache ops read and write every chunk of a forward at once when its sequences share pools (`ctx.paged`), else
chunk by chunk. Either way they hand the attention a `CacheView` (dsl/ops/cache_view.py).
"""

from __future__ import annotations

import functools

import torch

from dsl.context import ForwardContext, cast, take_rows
from dsl.ops.attend import ATTENTION_ROWS, attend
from dsl.ops.cache_view import CacheView, PagedEntries, PagedWindow
from dsl.ops.registry import op
from dsl.ops.static_attention import StaticBlock, StaticWindow, static_attention, static_block_attention
from dsl.ops.static_entries import StaticEntries, static_append
from dsl.step import StaticStep
from dsl.tensor import TensorType, context
from dsl.transfer import to_device


def _cache_type(x: TensorType, **attrs) -> tuple[TensorType]:
    return (TensorType((context, x.shape[-1]), "cache"),)


def _window_view(kv: torch.Tensor, layer: int, window: int, ctx: ForwardContext, lazy: bool = False) -> CacheView:
    """Per chunk: the last `window - 1` entries the window of `layer` holds before it (none before the chunk's
    `visible_from`), then the chunk's kv [N, D]. With `lazy`, a paged view gathers them when first read."""
    kept, lengths, first = ctx.memo(("window lists", window), lambda: _window_lists_host(ctx, window))
    batch = ctx.paged
    if batch is None:
        keys = []
        for c, k in zip(ctx.chunks, kept, strict=True):
            new = kv[c.rows]
            keys.append(torch.cat([c.state.storage.read_window(c.state, layer, k).to(new.device), new]) if k else new)
        return CacheView(keys, lengths=lengths, first=first)
    length, offset, first_t, slots, positions, kept_rows, new_rows = ctx.memo(
        ("window", window), lambda: _window_layout(ctx, window, sum(kept)))

    def gather() -> torch.Tensor:
        values = kv.new_empty(sum(lengths), kv.shape[-1], dtype=_view_dtype(kv.dtype))
        values[kept_rows] = cast(batch.cache.window_rows(layer, slots, positions), device=values.device)
        values[new_rows] = cast(kv, values.dtype)
        return values
    if not lazy:
        return CacheView(values=gather(), lengths=lengths, first=first, length=length, offset=offset, first_t=first_t)
    return CacheView(lengths=lengths, first=first, length=length, offset=offset, first_t=first_t,
                     ring=PagedWindow(batch.cache, layer, window, batch.slots, ctx), make=gather)


def _window_lists_host(ctx: ForwardContext, window: int) -> tuple[list[int], list[int], list[int]]:
    """Per chunk: how many kept entries a window of `window` shows it, its view's length and its view's first
    position. Set by the forward's layout alone: made once per forward and window, read (never written) by every
    layer's view."""
    kept = ctx.window_kept(window)
    lengths = [k + n for k, n in zip(kept, ctx.lengths, strict=True)]
    first = [s - k for s, k in zip(ctx.starts, kept, strict=True)]
    return kept, lengths, first


@functools.cache
def _view_dtype(dtype: torch.dtype) -> torch.dtype:
    """A window view's dtype for kv of `dtype`: fp32 or wider (`torch.promote_types` dispatches: asked once)."""
    return torch.promote_types(dtype, torch.float32)


def _window_layout(ctx: ForwardContext, window: int, total_kept: int) -> tuple[torch.Tensor, ...]:
    """The batched window view's index tensors, shared by every window of size `window`: per chunk [B] its length,
    offset in the view and first position; per kept entry [total_kept] its slot, position and row in the view; per
    token [N] its row."""
    seen = ctx.chunk_starts if ctx.visible_from is None else ctx.chunk_starts - to_device(ctx.visible_from, ctx.device)
    kept = seen.clamp(min=0, max=window - 1)  # [B]: positions each chunk sees before it
    length, first = kept + ctx.chunk_lengths, ctx.chunk_starts - kept
    offset = torch.cumsum(length, 0) - length
    base = offset - first  # [B]: row of position 0 in each chunk's part of the view
    run, slots, positions = ctx.paged.before(kept, total_kept)
    return length, offset, first, slots, positions, base[run] + positions, base[ctx.row_chunks] + ctx.positions


@op("kv_window_append", _cache_type, uses_context=True)
def kv_window_append(kv: torch.Tensor, *, layer: int, window: int, ctx) -> CacheView:
    """Append each chunk's kv [N, D] to its sequence's window; the cache keeps the last `window - 1` entries.

    The returned view holds the kept entries followed by the whole chunk, with their positions. A paged view is
    gathered when first read where the store leaves the ring holding all of it (`PagedWindow.intact`), else now, and
    the chunks the store overwrites keep their view in a `WindowSnapshot` (`snapshot`) for in-place attention.
    """
    if isinstance(ctx, StaticStep):
        kv_window_store(kv, layer=layer, window=window, ctx=ctx)
        return StaticWindow(ctx, layer, window)
    view = _window_view(kv, layer, window, ctx, lazy=True)
    if view.ring is not None and not view.ring.intact():
        view.flat()
        view.snapshot = view.ring.snapshot(kv, view.first)
    kv_window_store(kv, layer=layer, window=window, ctx=ctx)
    return view


@op("kv_window_store", _cache_type, uses_context=True)
def kv_window_store(kv: torch.Tensor, *, layer: int, window: int, ctx) -> None:
    """Store each chunk's kv [N, D] in its sequence's window of `layer` (the cache keeps the last `window - 1`
    entries) without attending: DSpark's main keys, which the draft layers read later."""
    if isinstance(ctx, StaticStep):  # every row at its position; padding rows nowhere
        ctx.cache.write_window_rows(layer, ctx.write_slots, ctx.positions, kv, masked=True)
        return
    batch = ctx.paged
    if batch is None:
        for c in ctx.chunks:
            c.state.storage.write_window(c.state, layer, kv[c.rows], window)
        return
    slots, rows = batch.ring_targets(batch.cache.windows[layer][1][0].shape[1])
    batch.cache.write_window_rows(layer, slots, ctx.positions, take_rows(kv, rows))


@op("kv_window_block", _cache_type, uses_context=True)
def kv_window_block(kv: torch.Tensor, *, layer: int, window: int, ctx) -> CacheView | StaticBlock:
    """A view of the `window - 1` entries the window of `layer` holds before each chunk, followed by the chunk's
    own kv [N, D], which is not stored: a DSpark draft block attends to both and leaves no trace. A paged view is
    gathered now (a later store in the forward may overwrite the rows it shows) and names its ring and the chunks'
    kv (`block`) for an attention that reads them in place; a static step's is a `StaticBlock`."""
    if isinstance(ctx, StaticStep):
        return StaticBlock(ctx, layer, window, kv)
    view = _window_view(kv, layer, window, ctx, lazy=True)
    view.flat()
    view.block = kv
    return view


@op("cache_append", _cache_type, uses_context=True)
def cache_append(entries, *, layer: int, name: str, ctx) -> CacheView:
    """Append new compressed entries (Ragged) to each sequence's `name` cache of `layer`; view the whole cache (a
    static step's: `StaticCompressed`)."""
    if isinstance(entries, StaticEntries):
        return static_append(entries, layer=layer, name=name, step=ctx)
    lengths = [f + n for f, n in zip(entries.first, entries.counts, strict=True)]
    batch = ctx.paged
    if batch is None:
        keys = []
        for c, new, first in zip(ctx.chunks, entries.split(), entries.first, strict=True):
            storage = c.state.storage
            if new.shape[0]:
                storage.write_entries(c.state, name, layer, first, new)
            whole = storage.read_entries(c.state, name, layer, first + new.shape[0]).to(new.device) if first else new
            keys.append(whole)
        return CacheView(keys, lengths=lengths)
    length, offset, run, index = ctx.entry_layout(entries.first, entries.counts)
    if entries.values.shape[0]:
        batch.cache.write_entry_rows(name, layer, batch.tables, run, index, entries.values)
    return CacheView(lengths=lengths, length=length, offset=offset,
                     paged=PagedEntries(batch.cache, name, layer, batch.tables, ctx))


def visible_entries(window: CacheView, compressed: CacheView | None, topk: torch.Tensor | None, *, window_size: int,
                    ctx: ForwardContext, dtype: torch.dtype, causal: bool = True,
                    index_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """What each token attends to, as one pool of keys and per-token entry lists: (kv [P, D] in `dtype`, idx
    `index_dtype` [N, S], -1 = none). A token sees the window entries whose positions lie in (pos - window_size, pos],
    oldest first (a contiguous run of at most `window_size`; with `causal` False its chunk's whole view), then its
    picks `topk` [N, K] (-1 = none) in order.

    The compressed entries come in whole (every chunk's cache) or only as picked (one row per token and pick),
    whichever is smaller. Only the picks differ between the layers of a forward: the index tensors made from its
    layout alone are made once (`ctx.memo`); without picks, the results may be the memo's and the view's own tensors:
    read them, never write."""
    lists = _window_lists(window, window_size, causal, ctx, index_dtype)
    pool = window.flat()
    total = sum(compressed.lengths) if compressed is not None and topk is not None else 0
    if total:
        picks = cast(topk, device=ctx.device)  # [N, K]
        gathered = compressed.paged is not None and picks.numel() < total
        key = ("picks", tuple(picks.shape), tuple(compressed.lengths), pool.shape[0], gathered, index_dtype)
        run, targets, has_entries = ctx.memo(key, lambda: _pick_layout(compressed, picks.shape, pool.shape[0],
                                                                       gathered, ctx, index_dtype))
        valid = picks >= 0 if has_entries is None else (picks >= 0) & has_entries
        if gathered:  # row m of the picked rows is token m // K's pick m % K
            picked = compressed.rows(run, picks.clamp(min=0).reshape(-1))
            picked_lists = torch.where(valid, targets, -1)
        else:  # targets: where each token's chunk's entries begin in the pool
            picked = compressed.flat()
            picked_lists = cast(torch.where(valid, targets + picks, -1), index_dtype)
        # Cast after the cat: rounding each value to `dtype` does not care where it sits.
        pool, lists = torch.cat([pool, picked]), torch.cat([lists, picked_lists], dim=1)
    return cast(pool, dtype), lists


def _window_lists(window: CacheView, window_size: int, causal: bool, ctx: ForwardContext,
                  index_dtype: torch.dtype) -> torch.Tensor:
    """Per token [N, window_size]: the rows of `window.flat()` it sees, oldest first, then -1. Set by the view's
    layout alone, which every layer's view of a window of the same size shares: made once per forward."""
    def make() -> torch.Tensor:
        dev, run, size = ctx.device, ctx.row_chunks, window_size
        length, offset, first = window.layout(dev)
        if causal:
            oldest, newest = torch.maximum(ctx.positions - size + 1, first[run]), ctx.positions  # [N]
        else:
            oldest, newest, size = first[run], (first + length - 1)[run], max(window.lengths, default=0)
        seen = oldest[:, None] + torch.arange(size, device=dev)  # [N, size] positions
        return torch.where(seen <= newest[:, None], (offset - first)[run][:, None] + seen, -1).to(index_dtype)
    key = ("window rows", window_size, causal, tuple(window.lengths), tuple(window.first or ()), index_dtype)
    return ctx.memo(key, make)


def _pick_layout(compressed: CacheView, shape: tuple[int, int], base: int, gathered: bool, ctx: ForwardContext,
                 index_dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """For picks of `shape` [N, K] of a compressed cache of this layout, after `base` window rows in the pool: whether
    each token's chunk has entries [N, 1] (None where every chunk has), and where its picks go. `gathered`: the
    chunk of each picked row [N * K] and the picked rows' places in the pool [N, K]; else only the offset of each
    token's chunk's entries [N, 1]."""
    dev, run = ctx.device, ctx.row_chunks
    entries, entry_offset, _ = compressed.layout(dev)
    has_entries = None if all(compressed.lengths) else (entries[run] > 0)[:, None]
    if not gathered:
        return None, base + entry_offset[run][:, None], has_entries
    places = torch.arange(base, base + shape[0] * shape[1], device=dev, dtype=index_dtype).reshape(shape)
    return run[:, None].expand(shape).reshape(-1), places, has_entries


def _attention_type(q: TensorType, *rest, **attrs) -> tuple[TensorType]:
    return (TensorType(q.shape, "float32"),)


@op("sparse_attention", _attention_type, uses_context=True)
def sparse_attention(q: torch.Tensor, window: CacheView, sink: torch.Tensor, compressed: CacheView | None = None,
                     topk: torch.Tensor | None = None, *, window_size: int, scale: float, causal: bool = True,
                     ctx) -> torch.Tensor:
    """Attention of q [N, H, D] over one shared K=V head: the window (0 <= i - j < window_size) plus the
    compressed entries picked by `topk` [N, K] (-1 = none). The per-head sink logit `sink` [H] joins the
    softmax denominator only. With `causal` False every key of the window view is visible to every query of the
    chunk (a DSpark draft block). Returns fp32 [N, H, D]."""
    if isinstance(window, StaticWindow):
        return static_attention(q, window, sink, compressed, topk, window_size=window_size, scale=scale)
    if isinstance(window, StaticBlock):
        return static_block_attention(q, window, sink, window_size=window_size, scale=scale)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if not ctx.compute_per_chunk:
        kv, idx = visible_entries(window, compressed, topk, window_size=window_size, ctx=ctx, dtype=torch.float32,
                                  causal=causal)
        for begin in range(0, q.shape[0], ATTENTION_ROWS):  # keys gathered for a block of queries: bounded memory
            rows = slice(begin, begin + ATTENTION_ROWS)
            out[rows] = attend(q[rows].float(), kv[idx[rows].clamp(min=0)], idx[rows] >= 0, sink, scale)
        return out
    for i, c in enumerate(ctx.chunks):
        qc = q[c.rows].float()  # [T, H, D]
        qpos = ctx.positions[c.rows]
        kv = window.keys[i].float()  # [P + T, D]
        delta = qpos[:, None] - window.positions[i].to(qpos.device)[None, :]
        mask = (delta >= 0) & (delta < window_size) if causal else torch.ones_like(delta, dtype=torch.bool)
        if compressed is not None and topk is not None and compressed.keys[i].shape[0]:
            entries = compressed.keys[i].float()  # [L, D]
            picks = topk[c.rows]  # [T, K]
            chosen = torch.zeros(c.length, entries.shape[0] + 1, dtype=torch.bool, device=q.device)
            chosen.scatter_(1, torch.where(picks >= 0, picks, entries.shape[0]), True)
            kv = torch.cat([kv, entries])
            mask = torch.cat([mask, chosen[:, :-1]], dim=1)
        logits = torch.einsum("thd,sd->hts", qc, kv) * scale  # [H, T, S]
        logits = logits.masked_fill(~mask[None], float("-inf"))
        sinks = sink.float()[:, None, None].expand(-1, c.length, 1)
        full = torch.cat([logits, sinks], dim=-1)
        probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)[..., :-1]
        out[c.rows] = torch.einsum("hts,sd->thd", probs, kv)
    return out
