"""The attention's lowering: sparse attention with sink over each query's window and selected compressed entries."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.attention.block_attention as block
import kernels.attention.paged_ops as paged
import kernels.attention.sparse_attention as attention
from dsl.graph import Node
from dsl.ops.static_attention import StaticBlock, StaticWindow
from kernels.attention.paged_attention import bucket_parts
from kernels.lowering import PLAIN, Call, Lowering, Params, Static, Variant, meta, param, token_planes


@dataclass(frozen=True)
class HeadsStatic(Static):
    """Queries [N, h, d]."""

    h: int
    d: int


class SparseAttention(Lowering):
    template, ops, static_type, sources = "sparse_attention", ("sparse_attention",), HeadsStatic, (attention,)

    def static(self, node: Node, params: Params) -> HeadsStatic | None:
        planes = token_planes(node.inputs[0].type)
        return None if planes is None or param(node, 2, params) is None else HeadsStatic(*planes)  # the sink a weight

    def formats(self, static: HeadsStatic) -> dict[int, str]:
        return {2: "fp32"}

    def default_config(self, static: HeadsStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        """The gathered kernel's heuristic (sparse_attention.py, the tuner's search), and the in-place kernel's parts
        (`parts`: paged_attention.py's `bucket_parts`)."""
        return self.complete(attention.default_config(tokens, static.h, static.d), static, tokens)

    def complete(self, config: dict, static: HeadsStatic, tokens: int) -> dict:
        """The in-place kernel's parts beside a config of the gathered kernel's (the tuned ones hold none)."""
        return config if "parts" in config else dict(config, parts=bucket_parts(tokens, static.h))

    def run(self, call: Call) -> torch.Tensor:
        """A static step's attention (dsl/step.py) reads the caches in place. Elsewhere, where `paged.IN_PLACE`, the
        chunks of decode and verification steps and DSpark's draft blocks over paged pools read the caches in place
        (kernels/attention/paged_attention.py; the draft blocks' kernel: kernels/attention/block_attention.py), and
        prefill chunks read their window's snapshot in place with the decode kernel, so a token's values follow
        neither what it is batched with nor how its prompt was chunked; the rest (unpaged caches, `IN_PLACE` off)
        gathers."""
        q, window, sink, compressed, topk = (list(call.args) + [None, None])[:5]
        a, ctx = call.attrs, call.ctx
        if isinstance(window, StaticWindow):  # a static step (dsl/step.py): only where `paged.serves` the head dim
            return paged.static_attention_op(q, window, sink, compressed, topk, window_size=a["window_size"],
                                             scale=a["scale"], config=call.config, dot_fp32=call.dot_fp32)
        if isinstance(window, StaticBlock):  # a static step's draft block
            return block.static_block_attention_op(q, window, sink, window_size=a["window_size"], scale=a["scale"],
                                                   config=call.config, dot_fp32=call.dot_fp32)
        causal = a.get("causal", True)
        common = dict(window_size=a["window_size"], scale=a["scale"], ctx=ctx, config=call.config,
                      dot_fp32=call.dot_fp32)
        if not causal and topk is None and paged.serves(q.shape[-1]) and block.block_chunks(window):
            return block.block_attention_op(q, window, sink, **common)  # draft blocks: as a static step's
        chunks, snapshot = [], False
        if paged.serves(q.shape[-1]):
            chunks = paged.in_place_chunks(window, compressed, topk, causal=causal)
            snapshot = paged.snapshot_serves(window, chunks)
        if chunks and all(chunks):
            return paged.paged_attention_op(q, window, sink, compressed, topk, **common)
        if snapshot and not any(chunks):
            return paged.paged_attention_op(q, window, sink, compressed, topk, snapshot=True, **common)
        if not any(chunks):
            return attention.sparse_attention_op(q, window, sink, compressed, topk, causal=causal, **common)
        near, far = ctx.memo(("in-place rows", tuple(chunks)), lambda: _rows_apart(ctx, chunks))
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        out[near] = paged.paged_attention_op(q, window, sink, compressed, topk, rows=near, **common)
        if snapshot:
            out[far] = paged.paged_attention_op(q, window, sink, compressed, topk, rows=far, snapshot=True, **common)
        else:
            out[far] = attention.sparse_attention_op(q, window, sink, compressed, topk, causal=causal, rows=far,
                                                     **common)
        return out

    def trace(self, call: Call) -> None:
        st, m = call.static, call.tokens
        dtype = torch.float32 if call.dot_fp32 else torch.bfloat16
        attention.sparse_attention(meta(m, st.h, st.d, dtype=dtype), meta(1, st.d, dtype=dtype),
                                   meta(m, 1, dtype=torch.int32), meta(st.h), scale=call.attrs["scale"],
                                   config=call.config, dot_fp32=call.dot_fp32)

    def invariant(self, config: dict) -> dict:
        """One part per token. The wrapper sizes the parts of a split from the widest entry list of the batch, so a
        token's part boundaries (and the combine's sum) would move with its neighbours; whole, a token's entries run
        in blocks of block_S from its first, and the blocks past its own entries are masked out exactly. The in-place
        kernel takes as many parts (kernels/attention/paged_attention.py: `tiles`): one."""
        return dict(config, split_kv=1, parts=1)


def _rows_apart(ctx, chunks: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The token rows [M] of the chunks marked in `chunks`, and those of the others, on the forward's device."""
    near = [r for c, ok in zip(ctx.chunks, chunks, strict=True) if ok for r in range(c.start, c.start + c.length)]
    far = [r for c, ok in zip(ctx.chunks, chunks, strict=True) if not ok for r in range(c.start, c.start + c.length)]
    return torch.tensor(near, device=ctx.device), torch.tensor(far, device=ctx.device)


SPARSE_ATTENTION = SparseAttention()
LOWERINGS = (SPARSE_ATTENTION,)

__all__ = ["LOWERINGS", "SPARSE_ATTENTION", "HeadsStatic"]
