"""The DSL op `sparse_attention` on the in-place kernel (kernels/attention/paged_attention.py): when a forward's
attention reads the caches in place, and the op's arguments as the kernel's operands.

The kernel knows only pools, block tables and index tensors; this module knows the views the cache ops hand the
attention (dsl/ops/cache_view.py), a forward's context and a static step's tensors (dsl/step.py). `IN_PLACE` and
`serves` say whether the in-place kernels serve a head dim at all, asked alike by the lowering
(kernels/attention/lowering.py), a static step's segments (graphs/segments.py) and the indexer's scores
(kernels/indexer/index_scores.py); `in_place_chunks` and `snapshot_serves` say which chunks of a forward take the
kernel; `paged_attention_op` (eager) and `static_attention_op` (a static step, its launch captured) turn the op's
arguments into the kernel's; the picks run at a few widths (`pick_width`), which the ahead-of-time build compiles
(`pick_widths`, `trace`).
"""

from __future__ import annotations

import os

import torch

from dsl.cache_format import EntryFormat
from kernels.attention.paged_attention import paged_attention, supports
from kernels.attention.paged_entries import index_operand
from kernels.lang import triton

# Whether the sparse_attention lowering takes the in-place kernel for the chunks `in_place_chunks` passes, static
# steps (dsl/step.py) capture their attention with it, and the indexer's scores read paged keys in place too
# (kernels/indexer/index_scores.py): on by default; DEEPINFER_PAGED_ATTENTION=0 gathers instead, and static steps then
# leave attention to the eager nodes, so a step's logits are the same with CUDA graphs and without either way.
IN_PLACE = os.environ.get("DEEPINFER_PAGED_ATTENTION", "1") != "0"


def serves(dim: int) -> bool:
    """Whether decode and verification attention over entries of `dim` values runs on the in-place kernel: it is on
    (`IN_PLACE`) and takes the dim. The eager lowering and a static step's segments (graphs/segments.py) ask the same,
    so a step's logits are the same with CUDA graphs and without."""
    return IN_PLACE and supports(dim)


def in_place_chunks(window, compressed, topk: torch.Tensor | None, *, causal: bool) -> list[bool]:
    """Per chunk of the forward: whether `paged_attention_op` serves its tokens from the ring. A causal attention
    over a paged window view, with picks only from a paged compressed view, and a chunk whose ring still holds its
    view after this forward's store (decode and verification chunks: `dsl.ops.cache_view.PagedWindow.intact_chunks`);
    the others (prefill chunks) from the view's `snapshot` where it has one (`snapshot_serves`), else gathered.
    DSpark's draft blocks take `block_attention_op` (kernels/attention/block_attention.py)."""
    ring = getattr(window, "ring", None)
    if not causal or ring is None or not (compressed is None or topk is None or compressed.paged is not None) \
            or getattr(window, "block", None) is not None:  # a draft block's keys are not in its ring
        return [False] * len(window.lengths)
    return ring.intact_chunks()


def snapshot_serves(window, chunks: list[bool]) -> bool:
    """Whether the chunks `in_place_chunks` leaves out (some, not all) read their view in place from the window's
    `WindowSnapshot`: every token of a forward then takes the in-place kernel, whose values follow only the token's
    entries, so a token's attention is the same however its prompt was chunked (batch-invariant runs need that)."""
    return getattr(window, "snapshot", None) is not None and getattr(window, "ring", None) is not None \
        and not all(chunks) and getattr(window, "block", None) is None


def pick_width(width: int) -> int:
    """The width the kernel runs a forward's picks at, for a top-k `width` wide (the longest compressed cache's entry
    count, up to the indexer's top-k): the next power of two, at least 64 (a block of entries), the picks past
    `width` none (-1). The ahead-of-time build compiles every width up to the indexer's top-k's (`pick_widths`): a
    few variants, where the forward's own width would make one for every cache length below the top-k."""
    return max(64, triton.next_power_of_2(width))


def pick_widths(topk: int) -> list[int]:
    """Every width `pick_width` gives for a top-k of up to `topk` picks."""
    widths = [64]
    while widths[-1] < pick_width(topk):
        widths.append(widths[-1] * 2)
    return widths


def _widened(picks: torch.Tensor) -> torch.Tensor:
    """Picks [N, K] padded with none (-1) to the width the kernel runs them at (`pick_width`)."""
    width = pick_width(picks.shape[1])
    return picks if width == picks.shape[1] else torch.nn.functional.pad(picks, (0, width - picks.shape[1]), value=-1)


def int32_index(ctx, t: torch.Tensor) -> torch.Tensor:
    """t as the kernel's int32 index, once per forward for each tensor the layers share (the memo keeps t alive, so
    its id stays its own)."""
    return ctx.memo(("int32 index", id(t)), lambda: (t, index_operand(t, "index", tuple(t.shape))))[1]


def paged_attention_op(q: torch.Tensor, window, sink: torch.Tensor, compressed=None, topk: torch.Tensor | None = None,
                       *, window_size: int, scale: float, ctx, config: dict | None = None, dot_fp32: bool = False,
                       rows: torch.Tensor | None = None, snapshot: bool = False) -> torch.Tensor:
    """The DSL op `sparse_attention` (same arguments, causal) on the in-place kernel, for the chunks
    `in_place_chunks` passes: q [N, H, D] -> fp32 [N, H, D]; with `rows` [M] (token rows of such chunks, on the
    device, made once a forward: the lowering's memo), fp32 [M, H, D] of those rows alone. With `snapshot`, the rows'
    window comes from the view's `WindowSnapshot` (the chunks the ring no longer holds: `snapshot_serves`)."""
    ring = window.ring
    fmt, parts = ring.cache.windows[ring.layer]
    slots = ring.slots
    if snapshot:
        fmt, parts, slots = window.snapshot.fmt, window.snapshot.parts, window.snapshot.slots
    _, _, first = window.layout(ctx.device)
    chunks, positions = int32_index(ctx, ctx.row_chunks), int32_index(ctx, ctx.positions)
    if rows is not None:
        q, chunks, positions = q[rows], chunks[rows], positions[rows]
        topk = topk[rows] if topk is not None else None
    pool = {}
    if topk is not None and compressed is not None:  # picks even where no chunk has entries: as many blocks
        entries = compressed.paged
        pool_fmt, _, pool_parts = entries.cache.compressed[(entries.name, entries.layer)]
        length, _, _ = compressed.layout(ctx.device)
        picks = _widened(int32_index(ctx, topk) if rows is None else index_operand(topk, "topk", tuple(topk.shape)))
        pool = dict(pool_fmt=pool_fmt, pool_parts=pool_parts, tables=int32_index(ctx, entries.tables),
                    lengths=int32_index(ctx, length), topk=picks)
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    q = q.to(dtype).contiguous()
    return paged_attention(q, sink.float().contiguous(), window_fmt=fmt, window_parts=parts,
                           slots=int32_index(ctx, slots), first=int32_index(ctx, first), row_chunks=chunks,
                           positions=positions, window_size=window_size, scale=scale, config=config, dot_fp32=dot_fp32,
                           **pool)


def static_attention_op(q: torch.Tensor, window, sink: torch.Tensor, compressed=None, topk: torch.Tensor | None = None,
                        *, window_size: int, scale: float, config: dict | None = None,
                        dot_fp32: bool = False) -> torch.Tensor:
    """The DSL op `sparse_attention` of a static step (dsl/step.py) over its window
    (`dsl.ops.static_attention.StaticWindow`) and the entries `topk` [R, K] picks of `compressed`
    (`dsl.ops.static_entries.StaticCompressed`): q [R, H, D] -> fp32 [R, H, D], every index the kernel reads taken
    from the step's tensors, so the launch reads whatever a later step writes there. The rows' values are the eager
    path's (`paged_attention_op`) bit for bit: a token's oldest visible position is max(pos - window_size + 1, floor)
    either way, and its picks run as many blocks."""
    step = window.step
    fmt, parts = step.cache.windows[window.layer]
    pool = {}
    if compressed is not None and topk is not None:
        pool_fmt, _, pool_parts = step.cache.compressed[(compressed.name, compressed.layer)]
        picks = _widened(index_operand(topk, "topk", tuple(topk.shape)))
        pool = dict(pool_fmt=pool_fmt, pool_parts=pool_parts, tables=step.tables, lengths=compressed.lengths(),
                    topk=picks)
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    return paged_attention(q.to(dtype).contiguous(), sink.float().contiguous(), window_fmt=fmt, window_parts=parts,
                           slots=step.chunk_slots, first=step.floors, row_chunks=step.row_chunks,
                           positions=step.positions32, window_size=window_size, scale=scale, config=config,
                           dot_fp32=dot_fp32, **pool)


def trace(heads: int, dim: int, *, window_size: int, scale: float, window_fmt: EntryFormat,
          pool_fmt: EntryFormat | None, topk: int, config: dict, dot_fp32: bool, device: str = "meta") -> None:
    """Call the wrapper once on empty pools of `device` for a node of `heads` x `dim` queries over a window in
    `window_fmt` and, with `topk` > 0, picks from a pool in `pool_fmt` (the AOT builder, on meta, records its launches:
    one variant per config and formats, whatever the number of rows or of sequences)."""
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    with torch.device(device):
        index = torch.zeros(1, dtype=torch.int32)
        pool = {}
        if topk and pool_fmt is not None:
            pool = dict(pool_fmt=pool_fmt, pool_parts=pool_fmt.storage((1, 1), dim), tables=index.view(1, 1),
                        lengths=index, topk=torch.zeros(1, topk, dtype=torch.int32))
        paged_attention(torch.zeros(1, heads, dim, dtype=dtype), torch.zeros(heads), window_fmt=window_fmt,
                        window_parts=window_fmt.storage((1, 1), dim), slots=index, first=index, row_chunks=index,
                        positions=index, window_size=window_size, scale=scale, config=config, dot_fp32=dot_fp32,
                        **pool)


__all__ = ["IN_PLACE", "in_place_chunks", "int32_index", "paged_attention_op", "pick_width", "pick_widths", "serves",
           "snapshot_serves", "static_attention_op", "trace"]
