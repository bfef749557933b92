"""Batched forms of the per-chunk ops, for training forwards: every chunk the same length, every sequence fresh.

The references loop over a forward's chunks (one per sequence), which on a GPU costs a few kernel launches per
chunk and op: with 32 sequences, most of a training step. When every chunk has the same length and starts at
position 0 (a training batch), the same arithmetic runs over a [B, T, ...] view at once. Nothing is written to the
sequences' caches (a training forward is not continued). Any other forward falls back to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl.ops import OPS
from dsl.ops.cache_view import CacheView
from dsl.ragged import Ragged


def fresh_length(ctx) -> int | None:
    """The common chunk length when every chunk has it and starts a fresh sequence, else None."""
    lengths = {c.length for c in ctx.chunks}
    if len(lengths) != 1 or any(c.start_pos for c in ctx.chunks):
        return None
    return lengths.pop()


@dataclass
class BlockWindow:
    """What DSpark draft blocks attend to, batched: per block the window of main keys before it then the block's
    own keys, keys [C, W + L, D], and which of them exist (a block near the start has fewer main keys) [C, W + L]."""

    keys: torch.Tensor
    valid: torch.Tensor


def kv_window_store(kv: torch.Tensor, *, layer: int, window: int, ctx) -> None:
    """Nothing to store for a training batch: the draft blocks get their windows from `draft_keys`."""
    if fresh_length(ctx) is None:
        OPS["kv_window_store"].reference(kv, layer=layer, window=window, ctx=ctx)


def kv_window_block(kv: torch.Tensor, windows: torch.Tensor, valid: torch.Tensor) -> BlockWindow:
    """Draft blocks' attention view from their main-key windows [C, W, D] (`valid` [C, W]) and new keys [C * L, D]."""
    blocks = windows.shape[0]
    new = kv.float().reshape(blocks, -1, kv.shape[-1])
    ones = torch.ones(blocks, new.shape[1], dtype=torch.bool, device=kv.device)
    return BlockWindow(torch.cat([windows.float(), new], dim=1), torch.cat([valid, ones], dim=1))


def block_attention(q: torch.Tensor, window: BlockWindow, sink: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The reference's non-causal attention (every valid key visible to every query of its block), batched over
    blocks: q [C * L, H, D] -> fp32 [C * L, H, D]."""
    blocks, heads, dim = window.keys.shape[0], q.shape[1], q.shape[2]
    length = q.shape[0] // blocks
    logits = torch.einsum("clhd,csd->chls", q.float().reshape(blocks, length, heads, dim), window.keys) * scale
    logits = logits.masked_fill(~window.valid[:, None, None, :], float("-inf"))  # [C, H, L, S]
    full = torch.cat([logits, sink.float()[None, :, None, None].expand(blocks, -1, length, 1)], dim=-1)
    probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("chls,csd->clhd", probs, window.keys).reshape(blocks * length, heads, dim)


def kv_window_append(kv: torch.Tensor, *, layer: int, window: int, ctx) -> CacheView:
    length = fresh_length(ctx)
    if length is None:
        return OPS["kv_window_append"].reference(kv, layer=layer, window=window, ctx=ctx)
    positions = torch.arange(length)
    return CacheView(list(kv.split(length)), [positions] * len(ctx.chunks))


def cache_append(entries: Ragged, *, layer: int, name: str, ctx) -> CacheView:
    if fresh_length(ctx) is None:
        return OPS["cache_append"].reference(entries, layer=layer, name=name, ctx=ctx)
    return CacheView(entries.split())


def compress_pool(kv: torch.Tensor, gate: torch.Tensor | None = None, *, layer: int, ratio: int, ctx) -> Ragged:
    length = fresh_length(ctx)
    if length is None or length % ratio:
        return OPS["compress_pool"].reference(kv, gate, layer=layer, ratio=ratio, ctx=ctx)
    batch, groups = len(ctx.chunks), length // ratio
    if ratio == 1:
        pooled = kv.float()
    else:
        shape = (batch * groups, ratio, kv.shape[-1])
        pooled = (kv.float().reshape(shape) * gate.float().reshape(shape).softmax(dim=1)).sum(dim=1)
    return Ragged(pooled, [groups] * batch, [0] * batch)


def engram_ngrams(ids: torch.Tensor, token_map: torch.Tensor, *, n: int, pad_id: int, ctx) -> torch.Tensor:
    length = fresh_length(ctx)
    if length is None:
        return OPS["engram_ngrams"].reference(ids, token_map, n=n, pad_id=pad_id, ctx=ctx)
    mapped = token_map[ids.long()].reshape(-1, length)  # [B, T]
    seq = torch.nn.functional.pad(mapped, (n - 1, 0), value=pad_id)  # [B, n - 1 + T]
    return torch.stack([seq[:, n - 1 - s : n - 1 - s + length] for s in range(n)], dim=-1).reshape(-1, n)


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: CacheView, *, ratio: int, ctx) -> torch.Tensor:
    """As the reference: [N, L] scores, -inf where the entry is not complete at the query's position."""
    length = fresh_length(ctx)
    if length is None:
        return OPS["index_scores"].reference(q, weights, keys, ratio=ratio, ctx=ctx)
    batch, heads, dim = len(ctx.chunks), q.shape[1], q.shape[2]
    k = torch.stack([t.float() for t in keys.keys])  # [B, L, d]
    s = torch.einsum("bthd,bld->bthl", q.float().reshape(batch, length, heads, dim), k).relu() * dim**-0.5
    w = weights.float().reshape(batch, length, heads, 1) * heads**-0.5
    scores = (s * w).sum(dim=2)  # [B, T, L]
    visible = (torch.arange(length, device=q.device)[:, None] + 1) // ratio  # [T, 1]
    hidden = torch.arange(k.shape[1], device=q.device)[None, :] >= visible  # [T, L]
    return scores.masked_fill(hidden, float("-inf")).reshape(batch * length, -1)


def sparse_attention(q: torch.Tensor, window: CacheView, sink: torch.Tensor, compressed: CacheView | None = None,
                     topk: torch.Tensor | None = None, *, window_size: int, scale: float, causal: bool = True,
                     ctx) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """(the reference's output [N, H, D], and for layers with compressed entries (attention probabilities on them
    summed over heads [B, T, L] detached, the picked-entry mask [B, T, L])); the second is None otherwise."""
    if isinstance(window, BlockWindow):
        return block_attention(q, window, sink, scale=scale), None
    length = fresh_length(ctx)
    if length is None or not causal:
        out = OPS["sparse_attention"].reference(q, window, sink, compressed, topk, window_size=window_size,
                                                scale=scale, causal=causal, ctx=ctx)
        return out, None
    batch, heads, dim = len(ctx.chunks), q.shape[1], q.shape[2]
    kv = torch.stack([t.float() for t in window.keys])  # [B, T, D]
    pos = torch.arange(length, device=q.device)
    delta = pos[:, None] - pos[None, :]
    mask = ((delta >= 0) & (delta < window_size)).expand(batch, length, length)  # [B, T, T]
    entries = 0
    if compressed is not None and topk is not None and compressed.keys[0].shape[0]:
        comp = torch.stack([t.float() for t in compressed.keys])  # [B, L, D]
        entries = comp.shape[1]
        picks = topk.reshape(batch, length, -1)
        chosen = torch.zeros(batch, length, entries + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(2, torch.where(picks >= 0, picks, entries), True)
        kv, mask = torch.cat([kv, comp], dim=1), torch.cat([mask, chosen[..., :-1]], dim=2)
    logits = torch.einsum("bthd,bsd->bhts", q.float().reshape(batch, length, heads, dim), kv) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))  # [B, H, T, S]
    full = torch.cat([logits, sink.float()[None, :, None, None].expand(batch, -1, length, 1)], dim=-1)
    probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)[..., :-1]
    out = torch.einsum("bhts,bsd->bthd", probs, kv).reshape(batch * length, heads, dim)
    if not entries:
        return out, None
    return out, (probs[..., length:].detach().sum(dim=1), mask[..., length:])
