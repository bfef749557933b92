"""The lowerings of the attention and the sparse indexer: the sparse attention with sink, the indexer's scores, and
its selection of entries (`topk_select`, `candidate_blocks`). graphs/lowering.py says what a lowering is and holds the
registry."""

from __future__ import annotations

import torch

import kernels.attention.sparse_attention as attention
import kernels.indexer.index_scores as indexer
import kernels.indexer.topk as topk
from dsl.graph import Node
from dsl.tensor import num_tokens
from graphs.lowering_base import Lowering, Params, meta, over_tokens, param

# ---- sparse attention --------------------------------------------------------------------------------------------

def _heads_static(node: Node, params: Params) -> dict | None:
    """Queries [N, heads, dim]: the attention's (its sink a weight) and the indexer's."""
    t = node.inputs[0].type
    if t is None or t.rank != 3 or t.shape[0] != num_tokens or (node.op == "sparse_attention"
                                                                 and param(node, 2, params) is None):
        return None
    return {"h": int(t.shape[1]), "d": int(t.shape[2])}


def _attention_run(args, attrs, st, config, ctx, dot_fp32):
    q, window, sink, compressed, topk = (list(args) + [None, None])[:5]
    return attention.sparse_attention_op(q, window, sink, compressed, topk, window_size=attrs["window_size"],
                                         scale=attrs["scale"], ctx=ctx, causal=attrs.get("causal", True),
                                         config=config, dot_fp32=dot_fp32)


def _attention_trace(st, attrs, config, m, dot_fp32):
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    attention.sparse_attention(meta(m, st["h"], st["d"], dtype=dtype), meta(1, st["d"], dtype=dtype),
                               meta(m, 1, dtype=torch.int32), meta(st["h"]), scale=attrs["scale"],
                               config=config, dot_fp32=dot_fp32)


# Invariant: one part per token. The wrapper sizes the parts of a split from the widest entry list of the batch,
# so a token's part boundaries (and the combine's sum) would move with its neighbours; whole, a token's entries
# run in blocks of block_S from its first, and the blocks past its own entries are masked out exactly.
SPARSE_ATTENTION = Lowering("sparse_attention", _heads_static, lambda st: {2: "fp32"}, _attention_run,
                            _attention_trace, lambda st, m: attention.default_config(m, st["h"], st["d"]),
                            lambda config: dict(config, split_kv=1))


# ---- the indexer's scores ----------------------------------------------------------------------------------------

def _scores_trace(st, attrs, config, m, dot_fp32):
    dtype, pos = torch.float32 if dot_fp32 else torch.bfloat16, meta(m, dtype=torch.int32)
    indexer.index_scores(meta(m, st["h"], st["d"], dtype=dtype), meta(m, st["h"]), meta(1, st["d"], dtype=dtype),
                         pos, pos, pos, ratio=attrs["ratio"], width=1, config=config, dot_fp32=dot_fp32)


# Every config is invariant: a token's entries run in blocks counted from its chunk's first, whatever the batch.
INDEX_SCORES = Lowering(
    "index_scores", _heads_static, lambda st: {},
    lambda args, attrs, st, config, ctx, f: indexer.index_scores_op(*args, ratio=attrs["ratio"], ctx=ctx,
                                                                    config=config, dot_fp32=f),
    _scores_trace, lambda st, m: indexer.default_config(m, st["h"], st["d"]))

# ---- the indexer's selection -------------------------------------------------------------------------------------

def _over_scores(node: Node) -> bool:
    """Scores [N, C]: a row of entries per token."""
    return over_tokens(node) and node.inputs[0].type.rank == 2


def _topk_static(node: Node, params: Params) -> dict | None:
    if not _over_scores(node):
        return None
    return {"topk": int(node.attrs["topk"]), "candidates": node.inputs[1] is not None}


def _topk_trace(st, attrs, config, m, dot_fp32):
    candidates = meta(m, 1, dtype=torch.bool) if st["candidates"] else None
    topk.topk_select(meta(m, 1), candidates, topk=attrs["topk"], config=config)


def _candidates_static(node: Node, params: Params) -> dict | None:
    if not _over_scores(node):
        return None
    return {"block": int(node.attrs["block"]), "topk_blocks": int(node.attrs["topk_blocks"])}


def _candidates_trace(st, attrs, config, m, dot_fp32):
    topk.candidate_blocks(meta(m, 1), meta(m, dtype=torch.int64), ratio=attrs["ratio"], block=attrs["block"],
                          topk_blocks=attrs["topk_blocks"], config=config)


# Every config is invariant: a row is one program, whose picks (ties to the lowest index) depend on its scores alone.
TOPK_SELECT = Lowering(
    "topk_select", _topk_static, lambda st: {},
    lambda args, attrs, st, config, ctx, f: topk.topk_select(
        args[0].contiguous(), None if args[1] is None else args[1].contiguous(), topk=attrs["topk"], config=config),
    _topk_trace, lambda st, m: topk.default_config(1, m))

CANDIDATE_BLOCKS = Lowering(
    "candidate_blocks", _candidates_static, lambda st: {},
    lambda args, attrs, st, config, ctx, f: topk.candidate_blocks_op(args[0], ratio=attrs["ratio"],
                                                                     block=attrs["block"],
                                                                     topk_blocks=attrs["topk_blocks"], ctx=ctx,
                                                                     config=config),
    _candidates_trace, lambda st, m: topk.default_config(st["block"], m))


__all__ = ["CANDIDATE_BLOCKS", "INDEX_SCORES", "SPARSE_ATTENTION", "TOPK_SELECT"]
