"""The indexer's selection kernels against `dsl.ops.indexer`'s `topk_select` and `candidate_blocks`: the same picks as
torch on scores without ties (the reference's order is torch's, so picks are compared as sets: sorted), ties at
the k-th score to the lowest indices (bitwise the batch-invariant references, dsl/ops/indexer.py), picks in
ascending order then -1, and a row's result the same alone and among others."""

from __future__ import annotations

import pytest
import torch

from dsl.context import ForwardContext, SequenceState
from dsl.ops.indexer import candidate_blocks as ref_candidate_blocks
from dsl.ops.indexer import invariant_candidate_blocks, invariant_topk_select
from dsl.ops.indexer import topk_select as ref_topk_select
from kernels.indexer.lowering import BlocksStatic, TopkStatic
from kernels.indexer.topk import candidate_blocks_op, topk_select
from kernels.launch import use_launcher
from kernels.lowering import PLAIN, Call
from kernels.registry import LOWERINGS
from tests.kernels.cases import INDEX_TOPK, gen

SMALL = {"block_N": 16, "num_warps": 4}  # several tiles a row, a partial last one
V41_BLOCK, V41_TOPK_BLOCKS = 8, 2048  # candidate_block_size, candidate_topk_blocks


def ascending(picks: torch.Tensor) -> torch.Tensor:
    """Picks [N, K] sorted ascending in each row, every -1 after them: the kernel's order."""
    big = torch.iinfo(torch.int64).max
    ordered = torch.where(picks >= 0, picks, big).sort(dim=-1).values
    return torch.where(ordered == big, -1, ordered)


def context(positions: list[int], device: str) -> ForwardContext:
    """One decode chunk per position."""
    return ForwardContext([SequenceState(num_tokens=p) for p in positions], [1] * len(positions), device=device)


def indexer_scores(n: int, width: int, ratio: int, device: str, seed: int = 0,
                   distinct: bool = False) -> tuple[torch.Tensor, ForwardContext]:
    """Scores [n, width] as `index_scores` makes them: -inf past each token's visible entries (some tokens see none,
    one sees every entry); `distinct`: values no two alike in a row (a shuffled ramp), else normal ones."""
    g = torch.Generator().manual_seed(seed)
    visible = torch.randint(0, width + 1, (n,), generator=g)
    visible[0] = width
    positions = (visible * ratio + torch.randint(0, ratio, (n,), generator=g)).tolist()
    if distinct:
        scores = (torch.rand(n, width, generator=g).argsort(dim=-1).float() - width / 2) * 2**-6
    else:
        scores = gen(n, width, seed=seed)
    scores = scores.masked_fill(torch.arange(width)[None, :] >= visible[:, None], float("-inf"))
    return scores.to(device), context(positions, device)


def tied(scores: torch.Tensor, levels: int = 4) -> torch.Tensor:
    """The scores on a few levels, +0.0 and -0.0 among them: most of a row ties."""
    q = (scores * 1.5).round().clamp(-levels, levels) * 0.5
    q = torch.where(q == 0, torch.where(scores > 0, 0.0, -0.0), q)
    return q.masked_fill(scores == float("-inf"), float("-inf"))


def check_topk(scores: torch.Tensor, candidates: torch.Tensor | None, topk: int, config: dict | None) -> None:
    wide = topk_select(scores, candidates, topk=topk, config=config)
    want = ref_topk_select(scores, candidates, topk=topk)
    assert wide.shape == (scores.shape[0], topk) and wide.dtype == want.dtype == torch.int64
    assert (wide[:, want.shape[1]:] == -1).all()  # topk wide whatever C: none past the C entries
    got = wide[:, : want.shape[1]]
    assert torch.equal(got, ascending(got))  # ascending, then -1
    # the same picks wherever no two scores tie (the scores of the picks where they might)
    full = scores if candidates is None else scores.masked_fill(~candidates, float("-inf"))
    def values(picks: torch.Tensor) -> torch.Tensor:
        return full.gather(1, picks.clamp(min=0)).masked_fill(picks < 0, float("-inf")).sort(dim=-1).values
    assert torch.equal(values(got), values(want))
    # ties to the lowest index: the batch-invariant reference, which is always topk wide
    assert torch.equal(got, invariant_topk_select(scores, candidates, topk=topk)[:, : got.shape[1]])


TOPK_CASES = [(6, 37, 5), (6, 37, 36), (5, 37, 37), (5, 37, 50), (4, 100, 16), (3, 1, 4), (3, 64, 1)]  # n, C, topk


@pytest.mark.parametrize("n,width,topk", TOPK_CASES)
@pytest.mark.parametrize("with_candidates", [False, True])
@pytest.mark.parametrize("config", [SMALL, None], ids=["small", "default"])
def test_topk_select_matches_reference(n, width, topk, with_candidates, config, device) -> None:
    scores, ctx = indexer_scores(n, width, 2, device, seed=width + topk, distinct=True)
    candidates = ref_candidate_blocks(scores, ratio=2, block=3, topk_blocks=4, ctx=ctx) if with_candidates else None
    got = topk_select(scores, candidates, topk=topk, config=config)
    want = ref_topk_select(scores, candidates, topk=topk)  # min(topk, C) wide: the kernel's -1 past C
    assert torch.equal(got[:, : want.shape[1]], ascending(want)) and (got[:, want.shape[1]:] == -1).all()
    check_topk(scores, candidates, topk, config)


@pytest.mark.parametrize("n,width,topk", TOPK_CASES)
@pytest.mark.parametrize("with_candidates", [False, True])
def test_topk_select_ties_go_to_the_lowest_index(n, width, topk, with_candidates, device) -> None:
    scores, ctx = indexer_scores(n, width, 2, device, seed=width)
    scores = tied(scores)
    candidates = ref_candidate_blocks(scores, ratio=2, block=4, topk_blocks=5, ctx=ctx) if with_candidates else None
    check_topk(scores, candidates, topk, SMALL)


def test_topk_select_of_equal_scores_keeps_the_first(device) -> None:
    scores = torch.tensor([[0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 1.0], [-0.0] * 7,
                           [float("-inf"), -0.0, float("-inf"), 0.0, 2.0, float("-inf"), -0.0]], device=device)
    got = topk_select(scores, topk=3, config={"block_N": 4, "num_warps": 4})
    assert got.tolist() == [[0, 1, 6], [0, 1, 2], [1, 3, 4]]


def test_topk_select_of_no_rows_or_no_picks(device) -> None:
    assert topk_select(gen(0, 9, device=device), topk=4).shape == (0, 4)
    assert topk_select(gen(3, 9, device=device), topk=0).shape == (3, 0)
    assert torch.equal(topk_select(gen(3, 0, device=device), topk=4), torch.full((3, 4), -1, device=device))


@pytest.mark.parametrize("topk", [1, 8, 16])
def test_topk_select_stops_at_the_last_finite_score(topk, device) -> None:
    """Rows as a static step gives them: wide, finite up to what each token sees, -inf after. The passes after the
    first stop at a row's last finite score, at or across a tile's edge (tiles of 16), with ties there too."""
    width, visible = 100, [0, 1, 15, 16, 17, 31, 32, 33, 64, 99, 100]
    scores = gen(len(visible), width, seed=topk, device=device)
    scores = scores.masked_fill(torch.arange(width, device=device)[None, :] >= torch.tensor(visible, device=device)[
        :, None], float("-inf"))
    check_topk(scores, None, topk, SMALL)
    check_topk(tied(scores), None, topk, SMALL)
    holes = scores.clone()
    holes[:, 1::3] = float("-inf")  # finite items apart, the last one anywhere in its tile
    check_topk(holes, None, topk, SMALL)


def check_candidates(scores: torch.Tensor, ctx: ForwardContext, ratio: int, block: int, topk_blocks: int,
                     config: dict | None, exact: bool) -> None:
    got = candidate_blocks_op(scores, ratio=ratio, block=block, topk_blocks=topk_blocks, ctx=ctx, config=config)
    stable = invariant_candidate_blocks(scores, ratio=ratio, block=block, topk_blocks=topk_blocks, ctx=ctx)
    assert got.dtype == torch.bool and torch.equal(got, stable)  # ties among blocks: the lowest first
    if exact:  # no two blocks' maxima tie: torch's picks
        assert torch.equal(got, ref_candidate_blocks(scores, ratio=ratio, block=block, topk_blocks=topk_blocks,
                                                     ctx=ctx))


@pytest.mark.parametrize("n,width,ratio,block,topk_blocks", [(6, 37, 2, 3, 4), (6, 37, 1, 4, 100), (5, 64, 4, 8, 3),
                                                            (4, 50, 2, 8, 1), (3, 5, 4, 8, 2), (4, 40, 1, 4, 0)])
@pytest.mark.parametrize("config", [{"block_N": 4, "num_warps": 4}, None], ids=["small", "default"])
def test_candidate_blocks_match_reference(n, width, ratio, block, topk_blocks, config, device) -> None:
    scores, ctx = indexer_scores(n, width, ratio, device, seed=width + block, distinct=True)
    check_candidates(scores, ctx, ratio, block, topk_blocks, config, exact=True)
    check_candidates(tied(scores), ctx, ratio, block, topk_blocks, config, exact=False)


def test_candidate_blocks_force_the_newest_block(device) -> None:
    """The block of entry (p + 1) // ratio - 1 is kept whatever its scores (all -inf in block 1), ahead of higher
    blocks; a token with no visible entry (p + 1 < ratio) forces none."""
    scores = torch.tensor([[5.0, 4.0, float("-inf"), float("-inf"), 3.0, 1.0, 2.0]] * 3, device=device)
    ctx = context([7, 13, 0], device)  # ratio 2: newest entries 3 (block 1), 6 (block 3) and none
    got = candidate_blocks_op(scores, ratio=2, block=2, topk_blocks=2, ctx=ctx)
    assert got.int().tolist() == [[1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 1], [1, 1, 0, 0, 1, 1, 0]]
    assert torch.equal(got, ref_candidate_blocks(scores, ratio=2, block=2, topk_blocks=2, ctx=ctx))


def test_candidate_blocks_force_nothing_past_the_scores(device) -> None:
    """A newest entry past the C scores (a position one entry ahead of the width) forces no block, as in the
    reference's layout: the tile's padding items past the last block (8 a tile here, 4 blocks) stay out of the top."""
    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.0, -1.0] * 2], device=device)  # 4 blocks of 4
    ctx = context([2 * 16 + 1], device)  # ratio 2: newest entry 16, block 4: past the 4 blocks
    got = candidate_blocks_op(scores, ratio=2, block=4, topk_blocks=2, ctx=ctx, config={"block_N": 8, "num_warps": 4})
    assert got.int().tolist() == [[1] * 4 + [0] * 4 + [1] * 4 + [0] * 4]  # blocks 0 and 2 (maxima 4, 0.5, 4, 0.5)
    assert torch.equal(got, ref_candidate_blocks(scores, ratio=2, block=4, topk_blocks=2, ctx=ctx))

def test_a_row_selects_the_same_alone_and_among_others(device) -> None:
    """A token's row alone, then among rows of longer and shorter caches (its own padded with -inf to the batch's
    width, as `index_scores` pads it): the same picks and mask, bitwise."""
    mine, _ = indexer_scores(1, 45, 2, device, seed=3)
    ctx1 = context([89], device)
    alone = topk_select(mine, topk=16, config=SMALL)[0]
    alone_inside = topk_select(mine, mine.isfinite(), topk=16, config=SMALL)[0]
    blocks = candidate_blocks_op(mine, ratio=2, block=4, topk_blocks=3, ctx=ctx1, config=SMALL)[0]
    for width, rows in ((70, 5), (45, 3), (50, 9)):
        others, ctx = indexer_scores(rows, width, 2, device, seed=width)
        others[2, :45], others[2, 45:] = mine[0], float("-inf")
        ctx = context([*ctx.positions.tolist()[:2], 89, *ctx.positions.tolist()[3:]], device)
        got = topk_select(others, topk=16, config=SMALL)[2]
        assert torch.equal(got[:16], alone) and (got[16:] == -1).all()
        assert torch.equal(topk_select(others, others.isfinite(), topk=16, config=SMALL)[2, :16], alone_inside)
        kept = candidate_blocks_op(others, ratio=2, block=4, topk_blocks=3, ctx=ctx, config=SMALL)[2]
        assert torch.equal(kept[:45], blocks)


@pytest.mark.parametrize("dot_fp32", [False, True])
def test_the_attention_reads_the_picks_alike_at_any_width(dot_fp32, device) -> None:
    """The attention kernel in its one-part (invariant) form over the picks [N, topk] (the kernel's width, past the C
    entries -1), and over their first min(topk, C): the same bits."""
    from kernels.attention.sparse_attention import sparse_attention_op
    from tests.kernels.attention.test_sparse_attention import SMALL as ONE_PART
    from tests.kernels.attention.test_sparse_attention import make_inputs

    (q, window, sink, compressed, _), ctx = make_inputs([(20, 1), (3, 1), (9, 2)], 4, 32, 8, 30, 12, device)
    scores = gen(ctx.num_tokens, 30, device=device, seed=4)
    scores[1, 7:] = float("-inf")
    padded = topk_select(scores, topk=40, config=SMALL)
    assert padded.shape == (4, 40) and (padded[1, 7:] == -1).all() and (padded[:, 30:] == -1).all()
    picks = padded[:, :30].contiguous()
    got, wide = (sparse_attention_op(q, window, sink, compressed, p, window_size=8, scale=32**-0.5, ctx=ctx,
                                     config=ONE_PART, dot_fp32=dot_fp32) for p in (picks, padded))
    assert torch.equal(got, wide)


def test_bad_arguments_name_the_argument(device) -> None:
    scores = gen(3, 8, device=device)
    with pytest.raises(ValueError, match="scores"):
        topk_select(scores.double(), topk=2)
    with pytest.raises(ValueError, match="candidates"):
        topk_select(scores, torch.ones(3, 7, dtype=torch.bool, device=device), topk=2)
    with pytest.raises(ValueError, match="topk"):
        topk_select(scores, topk=-1)
    with pytest.raises(ValueError, match="positions"):
        candidate_blocks_op(scores, ratio=1, block=2, topk_blocks=2, ctx=context([1, 2], device))
    with pytest.raises(ValueError, match="block"):
        candidate_blocks_op(scores, ratio=1, block=0, topk_blocks=2, ctx=context([1, 2, 3], device))


@pytest.mark.parametrize("op", ["topk_select", "candidate_blocks"])
def test_the_lowerings_trace_one_launch_for_any_width(op) -> None:
    """The AOT builder's record: one launch per node, one variant for decode buckets and one for prefill ones (the
    row width is a runtime int; `topk_select` takes smaller tiles over more than 64 tokens)."""
    lowering = LOWERINGS[op]
    if op == "topk_select":
        static, attrs = TopkStatic(INDEX_TOPK, True), {"topk": INDEX_TOPK}
    else:
        static = BlocksStatic(V41_BLOCK, V41_TOPK_BLOCKS)
        attrs = {"ratio": 4, "block": V41_BLOCK, "topk_blocks": V41_TOPK_BLOCKS}
    keys = set()
    for m in (1, 64, 2048):
        found = []
        with use_launcher(found.append):
            lowering.trace(Call(static, PLAIN, lowering.default_config(static, m), attrs, tokens=m))
        assert [call.name for call in found] == [f"{op}_kernel"]
        keys.add(found[0].key())
    assert len(keys) == (2 if op == "topk_select" else 1)


# ---- V4.1-Flash on the GPU ---------------------------------------------------------------------------------------

V41_CASES = [(n, width) for n in (1, 64, 2048) for width in (1, 300, 2048, 16384)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,width", V41_CASES)
def test_topk_select_at_v41_shapes_on_the_gpu(n, width) -> None:
    """index_topk 512 over C compressed entries, without and with candidates (V4.1's blocks of 8, top 2048, and a
    tighter top 64 that leaves fewer candidates than picks in some rows)."""
    scores, _ = indexer_scores(n, width, 4, "cuda", seed=width, distinct=True)
    got, want = topk_select(scores, topk=INDEX_TOPK), ref_topk_select(scores, topk=INDEX_TOPK)
    assert torch.equal(got[:, : want.shape[1]], ascending(want)) and (got[:, want.shape[1]:] == -1).all()
    normal, ctx = indexer_scores(n, width, 4, "cuda", seed=width + 1)
    for topk_blocks in (V41_TOPK_BLOCKS, 64):
        candidates = ref_candidate_blocks(normal, ratio=4, block=V41_BLOCK, topk_blocks=topk_blocks, ctx=ctx)
        check_topk(normal, candidates, INDEX_TOPK, None)
    check_topk(normal, None, INDEX_TOPK, None)
    check_topk(tied(normal), None, INDEX_TOPK, None)
    row = n // 2  # one row alone
    assert torch.equal(topk_select(normal[row:row + 1], topk=INDEX_TOPK)[0], topk_select(normal, topk=INDEX_TOPK)[row])


@pytest.mark.gpu
@pytest.mark.parametrize("n,width", V41_CASES)
def test_candidate_blocks_at_v41_shapes_on_the_gpu(n, width) -> None:
    """Blocks of 8 at ratio 4: V4.1's top 2048 (every block, up to C = 16384) and a top 64 that selects."""
    scores, ctx = indexer_scores(n, width, 4, "cuda", seed=width, distinct=True)
    normal, normal_ctx = indexer_scores(n, width, 4, "cuda", seed=width + 1)
    for topk_blocks in (V41_TOPK_BLOCKS, 64):
        check_candidates(scores, ctx, 4, V41_BLOCK, topk_blocks, None, exact=True)
        check_candidates(tied(normal), normal_ctx, 4, V41_BLOCK, topk_blocks, None, exact=False)
