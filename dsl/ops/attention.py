"""Sliding-window caches and sparse attention with a sink over window plus selected compressed entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl.ops.registry import op
from dsl.tensor import TensorType, context


@dataclass
class CacheView:
    """A per-chunk view of a cache after this forward's writes: keys [L_i, D] and, for windows, positions [L_i]."""

    keys: list[torch.Tensor]
    positions: list[torch.Tensor] | None = None


def _cache_type(x: TensorType, **attrs) -> tuple[TensorType]:
    return (TensorType((context, x.shape[-1]), "cache"),)


def _window_view(kv: torch.Tensor, layer: int, window: int, ctx) -> CacheView:
    """Per chunk: the last `window - 1` entries the window of `layer` holds before it, then the chunk's kv [N, D]."""
    keys, positions = [], []
    for c in ctx.chunks:
        new, kept = kv[c.rows], min(c.start_pos, window - 1)
        full = torch.cat([c.state.storage.read_window(c.state, layer, kept).to(new.device), new]) if kept else new
        keys.append(full)
        positions.append(torch.arange(c.start_pos + c.length - full.shape[0], c.start_pos + c.length))
    return CacheView(keys, positions)


@op("kv_window_append", _cache_type, uses_context=True)
def kv_window_append(kv: torch.Tensor, *, layer: int, window: int, ctx) -> CacheView:
    """Append each chunk's kv [N, D] to its sequence's window; the cache keeps the last `window - 1` entries.

    The returned view holds the kept entries followed by the whole chunk, with their positions.
    """
    view = _window_view(kv, layer, window, ctx)
    kv_window_store(kv, layer=layer, window=window, ctx=ctx)
    return view


@op("kv_window_store", _cache_type, uses_context=True)
def kv_window_store(kv: torch.Tensor, *, layer: int, window: int, ctx) -> None:
    """Store each chunk's kv [N, D] in its sequence's window of `layer` (the cache keeps the last `window - 1`
    entries) without attending: DSpark's main keys, which the draft layers read later."""
    for c in ctx.chunks:
        c.state.storage.write_window(c.state, layer, kv[c.rows], window)


@op("kv_window_block", _cache_type, uses_context=True)
def kv_window_block(kv: torch.Tensor, *, layer: int, window: int, ctx) -> CacheView:
    """A view of the `window - 1` entries the window of `layer` holds before each chunk, followed by the chunk's
    own kv [N, D], which is not stored: a DSpark draft block attends to both and leaves no trace."""
    return _window_view(kv, layer, window, ctx)


@op("cache_append", _cache_type, uses_context=True)
def cache_append(entries, *, layer: int, name: str, ctx) -> CacheView:
    """Append new compressed entries (Ragged) to each sequence's `name` cache of `layer`; view the whole cache."""
    keys = []
    for c, new, first in zip(ctx.chunks, entries.split(), entries.first, strict=True):
        storage = c.state.storage
        if new.shape[0]:
            storage.write_entries(c.state, name, layer, first, new)
        whole = storage.read_entries(c.state, name, layer, first + new.shape[0]).to(new.device) if first else new
        keys.append(whole)
    return CacheView(keys)


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
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
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
