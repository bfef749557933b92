"""The sparse indexer's lowerings: its scores (index_scores.py), and its selection of entries (topk.py: `topk_select`,
`candidate_blocks`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.indexer.index_scores as scores
import kernels.indexer.topk as topk
from dsl.graph import Node
from kernels.attention.lowering import HeadsStatic
from kernels.lowering import PLAIN, Call, Lowering, Params, Static, Variant, meta, over_tokens, token_planes


@dataclass(frozen=True)
class TopkStatic(Static):
    topk: int
    candidates: bool  # picks only among a candidate mask


@dataclass(frozen=True)
class BlocksStatic(Static):
    block: int  # entries a block
    topk_blocks: int


def _over_scores(node: Node) -> bool:
    """Scores [N, C]: a row of entries per token."""
    return over_tokens(node) and node.inputs[0].type.rank == 2


class IndexScores(Lowering):
    """Every config is invariant: a token's entries run in blocks counted from its chunk's first, whatever the
    batch."""

    template, ops, static_type, sources = "index_scores", ("index_scores",), HeadsStatic, (scores,)

    def static(self, node: Node, params: Params) -> HeadsStatic | None:
        planes = token_planes(node.inputs[0].type)
        return None if planes is None else HeadsStatic(*planes)

    def default_config(self, static: HeadsStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return scores.default_config(tokens, static.h, static.d)

    def run(self, call: Call) -> torch.Tensor:
        return scores.index_scores_op(*call.args, ratio=call.attrs["ratio"], ctx=call.ctx, config=call.config,
                                      dot_fp32=call.dot_fp32)

    def trace(self, call: Call) -> None:
        st, m = call.static, call.tokens
        dtype, pos = torch.float32 if call.dot_fp32 else torch.bfloat16, meta(m, dtype=torch.int32)
        scores.index_scores(meta(m, st.h, st.d, dtype=dtype), meta(m, st.h), meta(1, st.d, dtype=dtype), pos, pos,
                            pos, ratio=call.attrs["ratio"], width=1, config=call.config, dot_fp32=call.dot_fp32)


class TopkSelect(Lowering):
    """Every config is invariant: a row is one program, whose picks (ties to the lowest index) depend on its scores
    alone."""

    template, ops, static_type, sources = "topk_select", ("topk_select",), TopkStatic, (topk,)

    def static(self, node: Node, params: Params) -> TopkStatic | None:
        return TopkStatic(int(node.attrs["topk"]), node.inputs[1] is not None) if _over_scores(node) else None

    def default_config(self, static: TopkStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return topk.default_config(1, tokens)

    def run(self, call: Call) -> torch.Tensor:
        picked, candidates = call.args
        return topk.topk_select(picked.contiguous(), None if candidates is None else candidates.contiguous(),
                                topk=call.attrs["topk"], config=call.config)

    def trace(self, call: Call) -> None:
        candidates = meta(call.tokens, 1, dtype=torch.bool) if call.static.candidates else None
        topk.topk_select(meta(call.tokens, 1), candidates, topk=call.attrs["topk"], config=call.config)


class CandidateBlocks(Lowering):
    template, ops, static_type, sources = "candidate_blocks", ("candidate_blocks",), BlocksStatic, (topk,)

    def static(self, node: Node, params: Params) -> BlocksStatic | None:
        if not _over_scores(node):
            return None
        return BlocksStatic(int(node.attrs["block"]), int(node.attrs["topk_blocks"]))

    def default_config(self, static: BlocksStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return topk.default_config(static.block, tokens)

    def run(self, call: Call) -> torch.Tensor:
        a = call.attrs
        return topk.candidate_blocks_op(call.args[0], ratio=a["ratio"], block=a["block"], topk_blocks=a["topk_blocks"],
                                        ctx=call.ctx, config=call.config)

    def trace(self, call: Call) -> None:
        a, m = call.attrs, call.tokens
        topk.candidate_blocks(meta(m, 1), meta(m, dtype=torch.int64), ratio=a["ratio"], block=a["block"],
                              topk_blocks=a["topk_blocks"], config=call.config)


INDEX_SCORES, TOPK_SELECT, CANDIDATE_BLOCKS = IndexScores(), TopkSelect(), CandidateBlocks()
LOWERINGS = (INDEX_SCORES, TOPK_SELECT, CANDIDATE_BLOCKS)

__all__ = ["CANDIDATE_BLOCKS", "INDEX_SCORES", "LOWERINGS", "TOPK_SELECT", "BlocksStatic", "TopkStatic"]
