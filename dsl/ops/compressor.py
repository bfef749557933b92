"""The compressor of a KV-source layer: pools `ratio` consecutive tokens into one entry.

Partial groups wait in the sequence's cache across forwards; a group becomes an entry once complete. A sequence
of p tokens has completed p // ratio entries and its cache holds (at least) the p % ratio rows of its partial group:
every token's rows are written, so a sequence taken back to fewer tokens still finds its group's rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsl.context import ForwardContext, PagedBatch, cast, segments, take_rows
from dsl.ops.invariant import padded
from dsl.ops.invariant import softmax as invariant_softmax
from dsl.ops.registry import invariant, op
from dsl.ops.static_entries import StaticEntries, completes
from dsl.ragged import Ragged
from dsl.step import StaticStep
from dsl.tensor import TensorType, num_entries


def _entries_type(kv: TensorType, *rest, **attrs) -> tuple[TensorType]:
    return (TensorType((num_entries, kv.shape[-1]), "entries"),)


def _pool(groups: torch.Tensor, gates: torch.Tensor, softmax: Callable = torch.softmax) -> torch.Tensor:
    """Entries [G, D] of groups [G, ratio, D], weighted by the softmax over each group of gates [G, ratio, D]."""
    return (groups * softmax(gates, dim=1)).sum(dim=1)


def pool_rows(kv: torch.Tensor, gate: torch.Tensor, kept_kv: torch.Tensor, kept_gate: torch.Tensor,
              source: torch.Tensor) -> torch.Tensor:
    """Entries [G, D] of the groups whose members `source` [G, ratio] names among kv, gate [N, D] (rows below N)
    and kept_kv, kept_gate [P, D] (row r - N): torch's form of kernels/compressor/pool.py's `pool_groups`."""
    return _pool(torch.cat([kv, kept_kv])[source], torch.cat([gate, kept_gate])[source])


@op("compress_pool", _entries_type, uses_context=True)
def compress_pool(kv: torch.Tensor, gate: torch.Tensor | None = None, *, layer: int, ratio: int, ctx) -> Ragged:
    """Pool kv [N, D] in groups of `ratio` tokens, weighted by the softmax over the group of gate [N, D].

    Ratio 1 passes every token through (no gate). Returns the completed entries (fp32, pre-norm and pre-rope)
    of each sequence, with their absolute entry indices; over a static step (dsl/step.py), the entries its rows
    complete (`static_pool`).
    """
    if isinstance(ctx, StaticStep):
        return static_pool(kv, gate, layer=layer, ratio=ratio, step=ctx)
    return pool_entries(kv, gate, layer=layer, ratio=ratio, ctx=ctx)


_padded_pool = padded(compress_pool, pad=False)


@invariant("compress_pool", anywhere=True)
def invariant_compress_pool(kv: torch.Tensor, gate: torch.Tensor | None = None, *, layer: int, ratio: int,
                            ctx) -> Ragged:
    """Batch-invariant on any device: the softmax over a group and its weighted sum in a fixed order (on a GPU torch's
    reductions split a row's sum by the tensor's size), under InvariantElementwise. On the CPU outside a static step
    the mode changes only the pooling's softmax (the CPU's sums are torch's own), which is called directly instead:
    the mode's dispatch is not paid by every torch call of the op."""
    if isinstance(ctx, StaticStep) or kv.device.type != "cpu":
        return _padded_pool(kv, gate, layer=layer, ratio=ratio, ctx=ctx)
    return pool_entries(kv, gate, layer=layer, ratio=ratio, ctx=ctx, softmax=invariant_softmax)


def pool_entries(kv: torch.Tensor, gate: torch.Tensor | None, *, layer: int, ratio: int, ctx,
                 pool_groups: Callable | None = None, softmax: Callable = torch.softmax) -> Ragged:
    """`compress_pool`, the completed groups pooled by `pool_groups(kv, gate, kept_kv, kept_gate, source)` where
    given (kernels/compressor/pool.py), else by torch (`pool_rows`, `_pool` with `softmax`); a paged batch on the
    CPU, which pools chunk by chunk, keeps torch."""
    if isinstance(ctx, StaticStep):
        return static_pool(kv, gate, layer=layer, ratio=ratio, step=ctx, pool_groups=pool_groups)
    first = [s // ratio for s in ctx.starts]
    counts = [(s % ratio + n) // ratio for s, n in zip(ctx.starts, ctx.lengths, strict=True)]
    if ratio == 1:
        return Ragged(cast(kv, torch.float32), counts, first)
    if ctx.paged is not None:
        kv, gate = cast(kv, torch.float32), cast(gate, torch.float32)
        return Ragged(_pool_batch(kv, gate, layer, ratio, ctx, ctx.paged, sum(counts), pool_groups, softmax), counts,
                      first)
    values = []
    for c in ctx.chunks:
        storage, pending = c.state.storage, c.start_pos % ratio
        ckv, cgate = kv[c.rows].float(), gate[c.rows].float()
        if pending:
            kept_kv, kept_gate = storage.read_partial(c.state, layer, pending)
        storage.write_partial(c.state, layer, ckv, cgate)
        if pending:
            ckv, cgate = torch.cat([kept_kv.to(ckv.device), ckv]), torch.cat([kept_gate.to(ckv.device), cgate])
        usable = ckv.shape[0] // ratio * ratio
        if pool_groups is not None:  # the chunk's own rows, the kept ones first: no separate kept rows
            empty = ckv.new_empty(0, ckv.shape[-1])
            values.append(pool_groups(ckv.contiguous(), cgate.contiguous(), empty, empty,
                                      torch.arange(usable, device=ckv.device).reshape(-1, ratio)))
            continue
        values.append(_pool(ckv[:usable].reshape(-1, ratio, ckv.shape[-1]),
                            cgate[:usable].reshape(-1, ratio, ckv.shape[-1]), softmax))
    return Ragged(torch.cat(values) if values else kv.new_zeros(0, kv.shape[-1], dtype=torch.float32), counts, first)


def static_pool(kv: torch.Tensor, gate: torch.Tensor | None, *, layer: int, ratio: int, step: StaticStep,
                pool_groups: Callable | None = None) -> StaticEntries:
    """`compress_pool` over a static step: kv, gate [R, D] -> the entries its rows complete. Every real row's kv and
    gate are kept in the partial ring (padding rows' in the scratch slot); a group's members before its chunk come
    from the ring as it was before this step. Pooled as `pool_entries` pools: by `pool_groups` where given, on the CPU
    chunk by chunk in torch (its softmax rounds by its input's size)."""
    if ratio == 1:
        return StaticEntries(cast(kv, torch.float32), step, 1)
    kv, gate = cast(kv, torch.float32), cast(gate, torch.float32)
    rows, dim, dev = kv.shape[0], kv.shape[-1], kv.device
    cache, pos, chunk = step.cache, step.positions, step.row_chunks.long()
    member = pos[:, None] + torch.arange(1 - ratio, 1, device=dev)  # [R, ratio]: the group's positions
    slots = step.chunk_slots[chunk].long()[:, None].expand_as(member)
    kept_kv, kept_gate = cache.partial_rows(layer, slots.reshape(-1), member.clamp(min=0).reshape(-1))
    cache.write_partial_rows(layer, step.ring_slots(), pos, kv, gate)
    own = member >= step.chunk_starts[chunk].long()[:, None]  # a member of this step: its row, else a kept one
    row = torch.arange(rows, device=dev)[:, None] + member - pos[:, None]
    source = torch.where(own, row.clamp(min=0), rows + torch.arange(rows * ratio, device=dev).view(rows, ratio))
    done = completes(step, ratio)
    if dev.type == "cpu":
        groups, gates = torch.cat([kv, kept_kv])[source], torch.cat([gate, kept_gate])[source]
        pooled = kv.new_zeros(rows, dim)
        for c in step.row_chunks[done].unique_consecutive().tolist():  # chunk after chunk, its groups in one call
            at = (done & (step.row_chunks == c)).nonzero().squeeze(1)
            pooled[at] = _pool(groups[at], gates[at])
        return StaticEntries(pooled, step, ratio)
    pooled = (pool_groups or pool_rows)(kv.contiguous(), gate.contiguous(), kept_kv.contiguous(),
                                        kept_gate.contiguous(), source)
    return StaticEntries(torch.where(done[:, None], pooled, 0.0), step, ratio)


def _pool_batch(kv: torch.Tensor, gate: torch.Tensor, layer: int, ratio: int, ctx: ForwardContext,
                batch: PagedBatch, total: int, pool_groups: Callable | None = None,
                softmax: Callable = torch.softmax) -> torch.Tensor:
    """`compress_pool` of every chunk at once: read the partial groups, store the chunks' rows, pool the `total`
    completed groups (with `pool_groups` where given, else chunk by chunk with `softmax` on the CPU). kv, gate [N, D]
    fp32 -> [total, D]."""
    cache = batch.cache
    ring = cache.partials[layer].shape[2]
    slots, positions, source = ctx.memo(("pool", ratio), lambda: _pool_layout(ctx, batch, ratio, total))
    kept_kv, kept_gate = cache.partial_rows(layer, slots, positions)  # [P, D], read before this forward's rows land
    slots, rows = batch.ring_targets(ring)
    cache.write_partial_rows(layer, slots, ctx.positions, take_rows(kv, rows), take_rows(gate, rows))
    if not total:  # no group completed (most decode steps)
        return kv.new_empty(0, kv.shape[-1])
    kept_kv, kept_gate = cast(kept_kv, device=kv.device), cast(kept_gate, device=kv.device)
    if not ctx.compute_per_chunk:
        return (pool_groups or pool_rows)(kv.contiguous(), gate.contiguous(), kept_kv.contiguous(),
                                          kept_gate.contiguous(), source)
    groups, gates = torch.cat([kv, kept_kv])[source], torch.cat([gate, kept_gate])[source]
    # The CPU's softmax rounds by the size of its input: pool each chunk's groups in a call of their own.
    pooled, begin = kv.new_empty(total, kv.shape[-1]), 0
    for s, length in zip(ctx.starts, ctx.lengths, strict=True):
        end = begin + (s % ratio + length) // ratio
        if end > begin:
            pooled[begin:end] = _pool(groups[begin:end], gates[begin:end], softmax)
        begin = end
    return pooled


def _pool_layout(ctx: ForwardContext, batch: PagedBatch, ratio: int,
                 total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the partial groups lie (slots, positions [P]) and, for the `total` completed groups, the rows [G, ratio]
    of their members in the forward's rows followed by the P kept ones (None where `total` is 0)."""
    pending = ctx.chunk_starts % ratio
    _, slots, positions = batch.before(pending, sum(s % ratio for s in ctx.starts))
    if not total:
        return slots, positions, None
    # Member m of group k of chunk c is its extended chunk's row e = k * ratio + m: the chunk's pending kept rows, then
    # its own rows.
    run, k = segments((pending + ctx.chunk_lengths) // ratio, total)
    e = k[:, None] * ratio + torch.arange(ratio, device=ctx.device)  # [G, ratio]
    kept_base = ctx.num_tokens + torch.cumsum(pending, 0) - pending  # [B]: row of each chunk's first kept row
    source = torch.where(e < pending[run, None], kept_base[run, None] + e, (ctx.chunk_rows - pending)[run, None] + e)
    return slots, positions, source
