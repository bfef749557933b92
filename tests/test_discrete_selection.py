"""Index top-k with candidate blocks, and expert routing: bit for bit against plain-python formulas."""

from __future__ import annotations

import math

import pytest
import torch

from dsl.context import ForwardContext, SequenceState
from dsl.ops.indexer import candidate_blocks, topk_select
from dsl.ops.moe import moe_gate


def _scores(n: int, width: int, ratio: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(n) + 2 * width - n  # the last n positions of a 2 * width token sequence
    scores = torch.randn(n, width, generator=g)
    visible = (positions[:, None] + 1) // ratio
    scores = scores.masked_fill(torch.arange(width)[None, :] >= visible, float("-inf"))
    return scores, positions


def _context_at(positions: torch.Tensor) -> ForwardContext:
    state = SequenceState(num_tokens=int(positions[0]))
    return ForwardContext([state], [len(positions)])


def _python_candidates(row: list[float], position: int, ratio: int, block: int, topk_blocks: int) -> set[int]:
    blocks = [max(row[i : i + block]) for i in range(0, len(row), block)]
    newest = ((position + 1) // ratio - 1) // block
    ranked = sorted(range(len(blocks)), key=lambda j: (j != newest, -blocks[j], j))
    kept = [j for j in ranked[:topk_blocks] if j == newest or blocks[j] > -math.inf]
    return {i for j in kept for i in range(j * block, min((j + 1) * block, len(row)))}


@pytest.mark.parametrize("seed,block,topk_blocks", [(0, 4, 5), (1, 8, 2), (2, 3, 100)])
def test_candidate_blocks_match_formula(seed: int, block: int, topk_blocks: int) -> None:
    ratio, width = 2, 37
    scores, positions = _scores(20, width, ratio, seed)
    got = candidate_blocks(scores, ratio=ratio, block=block, topk_blocks=topk_blocks, ctx=_context_at(positions))
    for t in range(scores.shape[0]):
        want = _python_candidates(scores[t].tolist(), int(positions[t]), ratio, block, topk_blocks)
        assert set(torch.nonzero(got[t]).flatten().tolist()) == want


@pytest.mark.parametrize("seed,topk", [(0, 5), (1, 16), (2, 64)])
def test_topk_inside_candidates_matches_formula(seed: int, topk: int) -> None:
    ratio, width = 1, 40
    scores, positions = _scores(12, width, ratio, seed)
    cands = candidate_blocks(scores, ratio=ratio, block=4, topk_blocks=3, ctx=_context_at(positions))
    for with_candidates in (False, True):
        got = topk_select(scores, cands if with_candidates else None, topk=topk)
        for t in range(scores.shape[0]):
            row = [s if (not with_candidates or bool(cands[t, i])) else -math.inf for i, s in enumerate(scores[t].tolist())]
            finite = sorted((i for i, s in enumerate(row) if s > -math.inf), key=lambda i: -row[i])
            assert set(got[t][got[t] >= 0].tolist()) == set(finite[:topk])
            assert int((got[t] >= 0).sum()) == min(topk, len(finite))


def test_routing_matches_formula() -> None:
    g = torch.Generator().manual_seed(3)
    tokens, experts, hidden, topk = 30, 16, 24, 6
    x, w = torch.randn(tokens, hidden, generator=g), torch.randn(experts, hidden, generator=g) * 0.3
    bias = torch.randn(experts, generator=g) * 0.1
    weights, picked = moe_gate(x, w, bias, topk=topk, func="sqrtsoftplus", temp=1.0, normalize=True, scaling=1.5)
    for t in range(tokens):
        logits = [sum(float(a) * float(b) for a, b in zip(x[t], w[e], strict=True)) for e in range(experts)]
        s = [math.sqrt(math.log1p(math.exp(z)) if z <= 20 else z) for z in logits]
        chosen = sorted(range(experts), key=lambda e: -(s[e] + float(bias[e])))[:topk]
        assert sorted(picked[t].tolist()) == sorted(chosen)
        total = sum(s[e] for e in chosen)
        for slot, e in enumerate(picked[t].tolist()):
            assert math.isclose(float(weights[t, slot]), s[e] / (total + 1e-20) * 1.5, rel_tol=1e-5)
