"""Engram: n-gram hashes of the compressed token ids, table rows (the two fused: engram_hash_rows), and the gate that
adds them to the streams."""

from __future__ import annotations

import functools

import torch

from dsl.context import cast, take_rows
from dsl.ops.invariant import padded
from dsl.ops.registry import invariant, op
from dsl.step import StaticStep
from dsl.tensor import TensorType


def _ngrams_type(ids: TensorType, token_map: TensorType, *, n: int, **attrs) -> tuple[TensorType]:
    return (TensorType((ids.shape[0], n), "int64"),)


@op("engram_ngrams", _ngrams_type, uses_context=True)
def engram_ngrams(ids: torch.Tensor, token_map: torch.Tensor, *, n: int, pad_id: int, ctx) -> torch.Tensor:
    """For each token, the compressed ids of tokens p, p - 1, ..., p - n + 1 ([N, n] int64); positions before
    the sequence start get `pad_id`. Keeps each sequence's compressed ids (the last n - 1 at least) for later
    forwards."""
    if isinstance(ctx, StaticStep):
        return _ngrams_static(token_map[ids.long()], n, pad_id, ctx)
    if ctx.paged is not None:
        return _ngrams_batch(token_map[ids.long()], n, pad_id, ctx)
    out = torch.empty(ids.shape[0], n, dtype=torch.long, device=ids.device)
    for c in ctx.chunks:
        known = min(c.start_pos, n - 1)
        history = c.state.storage.read_history(c.state, known).to(ids.device) if known else ids.new_zeros(0)
        pad = torch.full((n - 1 - known,), pad_id, dtype=torch.long, device=ids.device)
        mapped = token_map[ids[c.rows].long()]
        seq = torch.cat([pad, history, mapped])  # [n - 1 + T]
        for shift in range(n):
            out[c.rows, shift] = seq[n - 1 - shift : n - 1 - shift + c.length]
        c.state.storage.write_history(c.state, mapped)
    return out


def _ngrams_batch(mapped: torch.Tensor, n: int, pad_id: int, ctx) -> torch.Tensor:
    """`engram_ngrams` of every chunk at once, from the compressed ids mapped [N]: one gather from the chunks' ids,
    the history pool (read whole, before the chunks' ids land: a few ids a slot) and the pad, then the chunks' ids
    stored."""
    batch, mapped = ctx.paged, cast(mapped, torch.long)
    history = batch.cache.history  # [slots, ring]
    index = ctx.memo(("ngrams", n, tuple(history.shape)), lambda: _ngram_layout(ctx, n, *history.shape))
    source = torch.cat([mapped, cast(history.view(-1), device=mapped.device), _longs((pad_id,), mapped.device)])
    slots, targets = batch.ring_targets(history.shape[1])
    batch.cache.write_history_rows(slots, ctx.positions, take_rows(mapped, targets))
    return source[index]


def _ngrams_static(mapped: torch.Tensor, n: int, pad_id: int, step: StaticStep) -> torch.Tensor:
    """`engram_ngrams` over a static step (dsl/step.py), from the compressed ids mapped [R]: each row's ids at
    positions p, p - 1, ..., p - n + 1 from its chunk's rows, its slot's ring as it was before the step, or the pad;
    then every real row's id kept (padding rows' in the scratch slot)."""
    cache, mapped = step.cache, cast(mapped, torch.long)
    rows, dev = mapped.shape[0], mapped.device
    shift = torch.arange(n, device=dev)
    wanted = step.positions[:, None] - shift  # [R, n] positions
    chunk = step.row_chunks.long()
    slots = step.chunk_slots[chunk].long()[:, None].expand_as(wanted)
    kept = torch.where(wanted >= 0, cache.history_rows(slots, wanted.clamp(min=0)), pad_id)
    own = wanted >= step.chunk_starts[chunk].long()[:, None]
    ids = torch.where(own, mapped[(torch.arange(rows, device=dev)[:, None] - shift).clamp(min=0)], kept)
    cache.write_history_rows(step.ring_slots(), step.positions, mapped)
    return ids


def _ngram_layout(ctx, n: int, num_slots: int, ring: int) -> torch.Tensor:
    """Rows [N, n] of `_ngrams_batch`'s source (the N chunk ids, the history pool [num_slots, ring] flat, the pad)
    of each token's ids at positions p, p - 1, ..., p - n + 1: in its chunk, in its slot's ring, or before the
    sequence (the pad)."""
    rows, shift = ctx.num_tokens, torch.arange(n, device=ctx.device)
    wanted = ctx.positions[:, None] - shift  # [N, n] positions
    slots, _ = ctx.paged.ring_targets(ring)  # [N]
    in_history = torch.where(wanted >= 0, rows + slots[:, None] * ring + wanted % ring, rows + num_slots * ring)
    start = ctx.chunk_starts[ctx.row_chunks][:, None]
    return torch.where(wanted >= start, torch.arange(rows, device=ctx.device)[:, None] - shift, in_history)


def _hash_type(ngrams: TensorType, *, primes: tuple, **attrs) -> tuple[TensorType]:
    return (TensorType((ngrams.shape[0], sum(len(p) for p in primes)), "int64"),)


@op("engram_hash", _hash_type)
def engram_hash(ngrams: torch.Tensor, *, multipliers: tuple[int, ...], primes: tuple[tuple[int, ...], ...],
                offsets: tuple[int, ...]) -> torch.Tensor:
    """Row ids [N, (n - 1) * heads] of one Engram layer: the k-gram hash XOR_{i<k}(tok_i * m_i) modulo each
    head's prime, plus the head's table offset, for k = 2..n."""
    products = ngrams * _longs(multipliers, ngrams.device)  # [N, n]; the multipliers are bounded: no overflow
    rolling, cols = products[:, 0], []
    for k in range(1, ngrams.shape[1]):
        rolling = torch.bitwise_xor(rolling, products[:, k])
        cols.append(rolling.unsqueeze(-1) % _longs(primes[k - 1], ngrams.device))
    return torch.cat(cols, dim=-1) + _longs(offsets, ngrams.device)


@functools.lru_cache(maxsize=256)
def _longs(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A layer's constants as a tensor on `device`, made once (a forward copies nothing from the host; CUDA-graph
    capture allows no such copy)."""
    return torch.tensor(values, dtype=torch.long, device=device)


@op("engram_rows", lambda ids, table, scale=None: (TensorType((*ids.shape, table.shape[-1])),))
def engram_rows(ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Table rows [N, cols, d] (fp32); fp8 tables are dequantised with their per-32 scales."""
    if table.dtype != torch.float8_e4m3fn or scale is None:
        return table[ids].float()
    from dsl.quant import dequantize_fp8_group

    flat = ids.reshape(-1)
    return dequantize_fp8_group(table[flat], scale[flat]).reshape(*ids.shape, table.shape[-1])


def _hash_rows_type(ngrams: TensorType, table: TensorType, scale: TensorType | None = None, *, primes: tuple,
                    **attrs) -> tuple[TensorType]:
    return (TensorType((ngrams.shape[0], sum(len(p) for p in primes), table.shape[-1])),)


@op("engram_hash_rows", _hash_rows_type)
def engram_hash_rows(ngrams: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None, *,
                     multipliers: tuple[int, ...], primes: tuple[tuple[int, ...], ...],
                     offsets: tuple[int, ...]) -> torch.Tensor:
    """engram_hash then engram_rows (made by the fusion pass where the rows are the hash's only reader): the table
    rows [N, (n - 1) * heads, d] (fp32) the n-grams [N, n] hash to."""
    return engram_rows(engram_hash(ngrams, multipliers=multipliers, primes=primes, offsets=offsets), table, scale)


@op("engram_gate", lambda h, *rest, **a: (TensorType(h.shape),))
def engram_gate(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, *,
                eps: float) -> torch.Tensor:
    """Streams h [N, hc, D] each gain gate_k * value, with kv [N, (hc + 1) * D] split into a key per stream and
    one value; gate = sigmoid(signed sqrt of the normalised dot of stream and key under q_weight * k_weight)."""
    n, hc, d = h.shape
    key, value = kv.float().split([hc * d, d], dim=-1)
    key = key.reshape(n, hc, d)
    h = h.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * (q_weight.float() * k_weight.float()) * key).sum(-1) * rstd * d**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return h + gate.unsqueeze(-1) * value.unsqueeze(1)


# Batch-invariant on any device: the gate's sums over D in a fixed order (on a GPU torch's reductions split a row's
# sum by the tensor's size; bench/invariance_probe.py finds such nodes), its sigmoid the invariant one.
invariant("engram_gate", anywhere=True)(padded(engram_gate, pad=False))
