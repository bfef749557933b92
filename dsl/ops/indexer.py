"""The sparse indexer: scores of queries against compressed-entry keys, candidate blocks and top-k; their
batch-invariant references."""

from __future__ import annotations

import torch

from dsl import native
from dsl.context import cast
from dsl.ops.cache_view import CacheView
from dsl.ops.invariant import MIN_COLS, padded_rows
from dsl.ops.registry import invariant, op
from dsl.ops.static_entries import StaticCompressed, visible_counts
from dsl.scalar import f32
from dsl.step import StaticStep
from dsl.tensor import TensorType, context
from dsl.transfer import to_device


def _scores_type(q: TensorType, w: TensorType, keys: TensorType, **attrs) -> tuple[TensorType]:
    return (TensorType((q.shape[0], context), "float32"),)


@op("index_scores", _scores_type, uses_context=True)
def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: CacheView, *, ratio: int, ctx) -> torch.Tensor:
    """score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s)) / sqrt(d) * H^-0.5 for q [N, H, d], weights [N, H].

    Entries not yet complete at the query's position ((p + 1) // ratio <= s) score -inf. Returns fp32
    [N, C] with C the longest cache of the batch; rows of shorter caches are padded with -inf. Over a static step
    (dsl/step.py), C is the cache's static width (`static_index_scores`).
    """
    if isinstance(ctx, StaticStep):
        return static_index_scores(q, weights, keys, ratio=ratio, step=ctx)
    width = max(keys.lengths, default=0)
    out = torch.full((q.shape[0] + 1, width), float("-inf"), dtype=torch.float32, device=q.device)
    if not ctx.compute_per_chunk:
        groups = ctx.memo(("scores", ratio, tuple(keys.lengths)), lambda: _score_layout(ctx, keys.lengths, ratio))
        for rows, safe, run, index, hidden in groups:
            _score_group(out, rows, safe, keys.rows(run, index), hidden, q, weights)
        return out[:-1]
    heads, dim = q.shape[1], q.shape[2]
    for i, c in enumerate(ctx.chunks):
        k = keys.keys[i].float()  # [L, d]
        if k.shape[0] == 0:
            continue
        s = torch.einsum("thd,ld->thl", q[c.rows].float(), k).relu_() * dim**-0.5
        w = weights[c.rows].float() * heads**-0.5
        scores = (s * w.unsqueeze(-1)).sum(dim=1)  # [T, L]
        out[c.rows, : k.shape[0]] = mask_incomplete(scores, ctx.positions[c.rows], ratio)
    return out[:-1]


def static_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: StaticCompressed, *, ratio: int,
                        step: StaticStep) -> torch.Tensor:
    """`index_scores` over a static step in torch (the reference of its kernel's static use): q [R, H, d], weights
    [R, H] -> fp32 [R, keys.width], -inf at the entries a row does not see."""
    heads, dim = q.shape[1], q.shape[2]
    k = keys.chunk_keys()[step.row_chunks.long()]  # [R, width, d]
    s = torch.einsum("thd,tcd->thc", q.float(), k).relu_() * dim**-0.5
    scores = (s * (weights.float() * heads**-0.5).unsqueeze(-1)).sum(dim=1)  # [R, width]
    hidden = torch.arange(keys.width, device=q.device) >= visible_counts(keys, step)[:, None]
    return scores.masked_fill(hidden, float("-inf"))


def _score_layout(ctx, entries: list[int], ratio: int) -> list[tuple[torch.Tensor, ...]]:
    """The chunks with entries in groups, each computed as one batched GEMM padded to its longest chunk (T tokens)
    and cache (L entries). Chunks go by the powers of two just above their token and entry counts, so a group does
    at most 4x the work of its chunks. Per group of G: the rows [G, T] of its tokens (N for padding), the same
    clamped to real rows, which entry each key column reads ([G * L] chunk, index) and what scores -inf [G, T, L]:
    padding and entries not yet complete at the token's position."""
    buckets: dict[tuple[int, int], list[int]] = {}
    for i, (t, e) in enumerate(zip(ctx.lengths, entries, strict=True)):
        if e:
            buckets.setdefault(((t - 1).bit_length(), (e - 1).bit_length()), []).append(i)
    out = []
    for chunks in buckets.values():
        group, dev = to_device(chunks, ctx.device), ctx.device
        length, cached = ctx.chunk_lengths[group], to_device([entries[i] for i in chunks], dev)  # [G]
        t = torch.arange(max(ctx.lengths[i] for i in chunks), device=dev)
        s = torch.arange(max(entries[i] for i in chunks), device=dev)
        rows = torch.where(t < length[:, None], ctx.chunk_rows[group, None] + t, ctx.num_tokens)  # [G, T]
        safe = rows.clamp(max=ctx.num_tokens - 1)
        index = torch.minimum(s, (cached - 1)[:, None])  # [G, L]
        visible = torch.minimum((ctx.positions[safe] + 1) // ratio, cached[:, None])  # [G, T]
        out.append((rows, safe, group[:, None].expand_as(index).reshape(-1), index.reshape(-1),
                    s >= visible[..., None]))
    return out


def _score_group(out: torch.Tensor, rows: torch.Tensor, safe: torch.Tensor, keys: torch.Tensor, hidden: torch.Tensor,
                 q: torch.Tensor, weights: torch.Tensor) -> None:
    """Scores of a group of G chunks (`_score_layout`) in one batched GEMM of queries [G, T * H, d] by keys
    [G, L, d], written to their rows of out [N + 1, C] (padding rows go to the last)."""
    (groups, tokens), heads, dim = rows.shape, q.shape[1], q.shape[2]
    k = keys.float().reshape(groups, -1, dim)  # [G, L, d]
    scores = torch.matmul(q[safe].float().reshape(groups, tokens * heads, dim), k.transpose(1, 2))
    scores = scores.relu_().reshape(groups, tokens, heads, -1) * dim**-0.5  # [G, T, H, L]
    w = weights[safe].float() * heads**-0.5  # [G, T, H]
    scores = (scores * w.unsqueeze(-1)).sum(dim=2)  # [G, T, L]
    out[rows, : k.shape[1]] = scores.masked_fill(hidden, float("-inf"))


def mask_incomplete(scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """-inf where entry s is not complete at the query's position p: (p + 1) // ratio <= s. scores [T, L]."""
    visible = (positions.unsqueeze(-1) + 1) // ratio  # [T, 1]
    entries = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    return scores.masked_fill(entries >= visible, float("-inf"))


@op("candidate_blocks", lambda scores, **a: (TensorType(scores.shape, "bool"),), uses_context=True)
def candidate_blocks(scores: torch.Tensor, *, ratio: int, block: int, topk_blocks: int, ctx) -> torch.Tensor:
    """Blocks of `block` entries scored by their max; keep the top `topk_blocks` finite blocks plus the block
    holding the newest visible entry. scores [N, C] -> bool mask [N, C] of entries in kept blocks."""
    blocks, columns = _block_maxima(scores, ratio, block, ctx)
    top = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep[:, columns]


def _block_maxima(scores: torch.Tensor, ratio: int, block: int, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """(each block's maximum score [N, B], +inf for the block of the token's newest visible entry; each entry's block
    [C]) of scores [N, C] in blocks of `block` entries."""
    width = scores.shape[-1]
    padded = scores if width % block == 0 else torch.nn.functional.pad(scores, (0, -width % block),
                                                                        value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(dim=-1)  # [N, B]
    newest, columns = ctx.memo(("blocks", ratio, block, blocks.shape[-1], width),
                               lambda: block_layout(ctx.positions, ratio, block, blocks.shape[-1], width))
    return blocks.masked_fill(newest, float("inf")), columns


def block_layout(positions: torch.Tensor, ratio: int, block: int, num_blocks: int,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token and block [N, num_blocks], whether the block holds the token's newest visible entry
    ((p + 1) // ratio - 1, floored by `block`: one floor division by ratio * block); per entry [width] its block."""
    newest = (positions[:, None] + (1 - ratio)) // (ratio * block)  # [N, 1]
    return (newest == torch.arange(num_blocks, device=positions.device),
            torch.arange(width, device=positions.device) // block)


def _topk_type(scores: TensorType, candidates: TensorType | None = None, *, topk: int) -> tuple[TensorType]:
    return (TensorType((scores.shape[0], topk), "int64"),)


@op("topk_select", _topk_type)
def topk_select(scores: torch.Tensor, candidates: torch.Tensor | None = None, *, topk: int) -> torch.Tensor:
    """Indices [N, min(topk, C)] of the highest finite scores (inside `candidates` when given); -1 where a
    row has fewer finite scores than picks."""
    if candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    k = min(topk, scores.shape[-1])
    top = scores.topk(k, dim=-1, sorted=False)
    return torch.where(top.values > float("-inf"), top.indices, torch.full_like(top.indices, -1))


# ---- batch-invariant references -----------------------------------------------------------------------------------

@invariant("index_scores")
def invariant_index_scores(q: torch.Tensor, weights: torch.Tensor, keys: CacheView, *, ratio: int,
                           ctx) -> torch.Tensor:
    """`index_scores` with at least MIN_COLS keys per GEMM, and the sum over heads as a sequential loop: a sum over a
    middle dim rounds differently with the size of the inner dim. Every chunk at once: its (token, head) rows padded
    to the longest chunk's (a row count `padded_rows` leaves alone), its keys to the longest cache's (zeros, which
    score -inf as entries not complete yet), one `bmm` (each chunk's element its own GEMM, dsl/ops/invariant.py)."""
    n, heads, dim = q.shape
    width = max(keys.lengths, default=0)
    if not width or not n:
        return torch.full((n, width), float("-inf"), dtype=torch.float32, device=q.device)
    tokens, columns = _padded_tokens(max(ctx.lengths), heads), max(MIN_COLS, width)
    rows, real, key_rows, key_real, written = ctx.memo(
        ("invariant scores", tuple(keys.lengths), tokens, columns), lambda: _scores_layout(ctx, keys, tokens, columns))
    flat = cast(keys.flat(), torch.float32, q.device)  # [sum L, d]
    k = torch.where(key_real, flat[key_rows], 0.0)  # [B, columns, d]
    qb = torch.where(real[..., None, None], cast(q, torch.float32)[rows], 0.0)  # [B, T, H, d]
    b = rows.shape[0]
    s = torch.bmm(qb.reshape(b, tokens * heads, dim), k.transpose(1, 2)).view(b, tokens, heads, columns)
    s = s[..., :width].relu_() * f32(dim**-0.5)  # [B, T, H, width]
    w = cast(weights, torch.float32)[rows] * f32(heads**-0.5)  # [B, T, H]
    if (scores := native.weighted_heads(s, w)) is None:  # the same products and adds in C, else in torch
        scores = s[:, :, 0] * w[..., :1]
        for h in range(1, heads):
            scores = scores + s[:, :, h] * w[..., h : h + 1]
    scores = mask_incomplete(scores.reshape(b * tokens, width), ctx.positions[rows].reshape(-1), ratio)
    return scores[written]


def _scores_layout(ctx, keys: CacheView, tokens: int, columns: int) -> tuple[torch.Tensor, ...]:
    """For chunks padded to `tokens` tokens and `columns` keys: each (chunk, token)'s row [B, T] (clamped) and whether
    it is real, each (chunk, key)'s row of the flat cache [B, columns, 1] (clamped) and whether it is real, and for
    each of the forward's rows in order its place among the B * T."""
    dev = ctx.device
    t = torch.arange(tokens, device=dev)
    real = t < ctx.chunk_lengths[:, None]  # [B, T]
    rows = (ctx.chunk_rows[:, None] + t).clamp(max=max(ctx.num_tokens - 1, 0))
    length, offset, _ = keys.layout(dev)
    c = torch.arange(columns, device=dev)
    key_real = (c < length[:, None])[..., None]  # [B, columns, 1]
    key_rows = (offset[:, None] + c).clamp(max=max(sum(keys.lengths) - 1, 0))
    written = real.reshape(-1).nonzero().squeeze(1)  # chunk after chunk, token after token: the forward's order
    return rows, real, key_rows, key_real, written


def _padded_tokens(tokens: int, heads: int) -> int:
    """The fewest tokens >= `tokens` whose rows of (token, head) make a row count `padded_rows` leaves alone."""
    while padded_rows(tokens * heads) != tokens * heads:
        tokens += 1
    return tokens


def stable_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [N, k] of the k highest scores per row, equal scores lowest index first (rows padded with -inf):
    torch's top-k picks among equal scores depend on the row width, a stable sort's do not."""
    if scores.shape[-1] < k:
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[-1]), value=float("-inf"))
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


@invariant("candidate_blocks", anywhere=True)
def invariant_candidate_blocks(scores: torch.Tensor, *, ratio: int, block: int, topk_blocks: int,
                               ctx) -> torch.Tensor:
    """`candidate_blocks` with ties among block maxima broken by the lowest block index."""
    blocks, columns = _block_maxima(scores, ratio, block, ctx)
    top = stable_top(blocks, topk_blocks)[:, : blocks.shape[-1]]
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > float("-inf"))
    return keep[:, columns]


@invariant("topk_select", anywhere=True)
def invariant_topk_select(scores: torch.Tensor, candidates: torch.Tensor | None = None, *, topk: int) -> torch.Tensor:
    """`topk_select` always `topk` wide, ties to the lowest index, picks in ascending order and -1 last: with ties, or
    a row width set by the batch's longest cache, torch's top-k picks (and their order, which is the attention's
    summation order) can change with the batch."""
    if candidates is not None:
        scores = scores.masked_fill(~candidates, float("-inf"))
    top = stable_top(scores, topk)  # [N, topk]
    finite = torch.nn.functional.pad(scores, (0, max(0, topk - scores.shape[-1])), value=float("-inf"))
    picks = torch.where(finite.gather(-1, top) > float("-inf"), top, torch.full_like(top, -1))
    return _ascending(picks)


def _ascending(picks: torch.Tensor) -> torch.Tensor:
    """Picks [N, K] sorted ascending with every -1 after the picks."""
    big = torch.iinfo(torch.long).max
    ordered = torch.where(picks >= 0, picks, big).sort(dim=-1).values
    return torch.where(ordered == big, -1, ordered)
