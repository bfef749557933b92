"""The sparse indexer: scores of queries against compressed-entry keys, candidate blocks and top-k."""

from __future__ import annotations

import torch

from dsl.ops.attention import CacheView
from dsl.ops.registry import op
from dsl.tensor import TensorType, context


def _scores_type(q: TensorType, w: TensorType, keys: TensorType, **attrs) -> tuple[TensorType]:
    return (TensorType((q.shape[0], context), "float32"),)


@op("index_scores", _scores_type, uses_context=True)
def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: CacheView, *, ratio: int, ctx) -> torch.Tensor:
    """score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s)) / sqrt(d) * H^-0.5 for q [N, H, d], weights [N, H].

    Entries not yet complete at the query's position ((p + 1) // ratio <= s) score -inf. Returns fp32
    [N, C] with C the longest cache of the batch; rows of shorter caches are padded with -inf.
    """
    width = max((k.shape[0] for k in keys.keys), default=0)
    out = torch.full((q.shape[0], width), float("-inf"), dtype=torch.float32, device=q.device)
    heads, dim = q.shape[1], q.shape[2]
    for i, c in enumerate(ctx.chunks):
        k = keys.keys[i].float()  # [L, d]
        if k.shape[0] == 0:
            continue
        s = torch.einsum("thd,ld->thl", q[c.rows].float(), k).relu_() * dim**-0.5
        w = weights[c.rows].float() * heads**-0.5
        scores = (s * w.unsqueeze(-1)).sum(dim=1)  # [T, L]
        out[c.rows, : k.shape[0]] = mask_incomplete(scores, ctx.positions[c.rows], ratio)
    return out


def mask_incomplete(scores: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """-inf where entry s is not complete at the query's position p: (p + 1) // ratio <= s. scores [T, L]."""
    visible = (positions.unsqueeze(-1) + 1) // ratio  # [T, 1]
    entries = torch.arange(scores.shape[-1], device=scores.device)[None, :]
    return scores.masked_fill(entries >= visible, float("-inf"))


@op("candidate_blocks", lambda scores, **a: (TensorType(scores.shape, "bool"),), uses_context=True)
def candidate_blocks(scores: torch.Tensor, *, ratio: int, block: int, topk_blocks: int, ctx) -> torch.Tensor:
    """Blocks of `block` entries scored by their max; keep the top `topk_blocks` finite blocks plus the block
    holding the newest visible entry. scores [N, C] -> bool mask [N, C] of entries in kept blocks."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(dim=-1)  # [N, B]
    newest = ((ctx.positions.unsqueeze(-1) + 1) // ratio - 1) // block  # [N, 1]
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1], device=scores.device) == newest, float("inf"))
    top = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
    keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :width]


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
