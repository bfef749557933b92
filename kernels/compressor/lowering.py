"""The compressor's lowering: its pooling of a forward's completed groups on the kernel (pool.py); the partial groups'
rows are read and kept as the reference keeps them (`dsl.ops.compressor.pool_entries`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.compressor.pool as pool
from dsl.graph import Node
from dsl.ops.compressor import pool_entries
from dsl.ragged import Ragged
from kernels.lowering import PLAIN, Call, Lowering, Params, Static, Variant, meta, over_tokens


@dataclass(frozen=True)
class PoolStatic(Static):
    d: int
    ratio: int  # rows a group


class CompressPool(Lowering):
    template, ops, static_type, sources = "compress_pool", ("compress_pool",), PoolStatic, (pool,)

    def static(self, node: Node, params: Params) -> PoolStatic | None:
        t = node.inputs[0].type
        if node.attrs["ratio"] == 1 or not over_tokens(node) or t.rank != 2 or node.inputs[1] is None:
            return None
        return PoolStatic(int(t.shape[-1]), int(node.attrs["ratio"]))

    def default_config(self, static: PoolStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return pool.default_config(static.d)

    def run(self, call: Call) -> Ragged:
        kv, gate = call.args
        return pool_entries(kv, gate, layer=call.attrs["layer"], ratio=call.attrs["ratio"], ctx=call.ctx,
                            pool_groups=lambda *a: pool.pool_groups(*a, config=call.config))

    def trace(self, call: Call) -> None:
        m, d = call.tokens, call.static.d
        pool.pool_groups(*(meta(m, d) for _ in range(4)), meta(m, call.static.ratio, dtype=torch.int64),
                         config=call.config)


COMPRESS_POOL = CompressPool()
LOWERINGS = (COMPRESS_POOL,)

__all__ = ["COMPRESS_POOL", "LOWERINGS", "PoolStatic"]
