"""A static step's window (dsl/step.py) as its attention reads it, and the torch reference of that attention: the
rows of a decode or verification step over the window rings and the compressed entries their picks name, or of a
DSpark draft block over the ring before it and its own keys, every index read from the step's tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl.ops.attend import ATTENTION_ROWS, attend
from dsl.ops.static_entries import StaticCompressed
from dsl.step import StaticStep


@dataclass
class StaticWindow:
    """A window as a static step's attention reads it (dsl/step.py): the ring of `layer` in the step's pools, after the
    step's store; the token of row t sees the positions (pos_t - window_size, pos_t] from its chunk's floor on."""

    step: StaticStep
    layer: int
    window: int


@dataclass
class StaticBlock:
    """A DSpark draft block's view in a static step (`kv_window_block`'s): each chunk's `window - 1` positions before
    its first in the ring of `layer` (from its floor on), then the chunk's own keys, rows of `kv` [R, D] that are
    never stored; every row of a chunk sees all of it."""

    step: StaticStep
    layer: int
    window: int
    kv: torch.Tensor


def static_block_attention(q: torch.Tensor, block: StaticBlock, sink: torch.Tensor, *, window_size: int,
                           scale: float) -> torch.Tensor:
    """`sparse_attention` (non-causal) of a static step's rows over their chunk's `StaticBlock` view (the reference
    of the draft-block kernel's static use, kernels/attention/block_attention.py `static_block_attention_op`):
    q [R, H, D] -> fp32 [R, H, D]."""
    step = block.step
    chunk = step.row_chunks.long()
    start = step.chunk_starts.long()[chunk]  # [R]: each row's chunk's first position
    oldest = torch.maximum(start - window_size + 1, step.floors.long()[chunk])
    seen = oldest[:, None] + torch.arange(window_size - 1, device=start.device)  # [R, window - 1] positions
    visible = seen < start[:, None]
    slots = step.chunk_slots.long()[chunk][:, None].expand_as(seen)
    ring = step.cache.window_rows(block.layer, slots.reshape(-1), seen.reshape(-1)).reshape(*seen.shape, -1)
    ring = torch.where(visible[..., None], ring, 0.0)
    first = step.chunk_rows.long()[chunk]
    end = first + (step.chunk_ends - step.chunk_starts).long()[chunk]
    rows = torch.arange(q.shape[0], device=start.device)
    own = (rows[None, :] >= first[:, None]) & (rows[None, :] < end[:, None])  # [R, R]: the rows of one's chunk
    kv = block.kv.float()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for begin in range(0, q.shape[0], ATTENTION_ROWS):
        part = slice(begin, begin + ATTENTION_ROWS)
        keys = torch.cat([ring[part], kv[None].expand(ring[part].shape[0], -1, -1)], dim=1)
        out[part] = attend(q[part].float(), keys, torch.cat([visible[part], own[part]], dim=1), sink, scale)
    return out


def static_window_entries(window: StaticWindow, window_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What each row of a static step sees of its window, oldest first: fp32 keys [R, window_size, D] (zeros where
    not visible) and which are visible [R, window_size]: positions from max(pos - window_size + 1, floor) to pos."""
    step = window.step
    pos = step.positions  # [R]
    oldest = torch.maximum(pos - window_size + 1, step.floors[step.row_chunks].long())  # [R]
    seen = oldest[:, None] + torch.arange(window_size, device=pos.device)  # [R, S] positions
    visible = seen <= pos[:, None]
    slots = step.chunk_slots[step.row_chunks].long()[:, None].expand_as(seen)
    keys = step.cache.window_rows(window.layer, slots.reshape(-1), seen.reshape(-1))  # [R * S, D]
    keys = keys.reshape(*seen.shape, -1)
    return torch.where(visible[..., None], keys, 0.0), visible


def static_picks(compressed: StaticCompressed, topk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries a static step's rows picked, in pick order: fp32 keys [R, K, D] (zeros where none) and which are
    real [R, K]: picks topk [R, K] (-1 = none) below their chunk's entry count."""
    step = compressed.step
    chunk = step.row_chunks.long()
    real = (topk >= 0) & (topk < compressed.lengths()[chunk].long()[:, None])
    run = chunk[:, None].expand_as(topk).reshape(-1)
    keys = step.cache.entry_rows(compressed.name, compressed.layer, step.tables, run, topk.clamp(min=0).reshape(-1))
    keys = keys.reshape(*topk.shape, -1)
    return torch.where(real[..., None], keys, 0.0), real


def static_attention(q: torch.Tensor, window: StaticWindow, sink: torch.Tensor,
                     compressed: StaticCompressed | None = None, topk: torch.Tensor | None = None, *,
                     window_size: int, scale: float) -> torch.Tensor:
    """`sparse_attention` of a static step's rows over their windows and the entries `topk` [R, K] picks of
    `compressed` (the reference of the in-place kernel's static use, kernels/attention/paged_ops.py
    `static_attention_op`): q [R, H, D] -> fp32 [R, H, D]."""
    keys, visible = static_window_entries(window, window_size)
    if compressed is not None and topk is not None:
        picked, real = static_picks(compressed, topk)
        keys, visible = torch.cat([keys, picked], dim=1), torch.cat([visible, real], dim=1)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for begin in range(0, q.shape[0], ATTENTION_ROWS):
        rows = slice(begin, begin + ATTENTION_ROWS)
        out[rows] = attend(q[rows].float(), keys[rows], visible[rows], sink, scale)
    return out


__all__ = ["StaticBlock", "StaticWindow", "static_attention", "static_block_attention", "static_picks",
           "static_window_entries"]
