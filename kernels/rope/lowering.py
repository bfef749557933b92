"""The rotary embedding's lowerings: over the tokens (`rope`) and over the compressed entries a forward completes
(`rope_entries`: entry j of ratio r at position j * r), one kernel (rope.py) and template for both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.rope.rope as rope
from dsl.graph import Node
from dsl.ops.rope import _freqs_on, inv_freq
from dsl.ops.static_entries import StaticEntries, entry_positions
from dsl.ragged import Ragged
from kernels.lowering import PLAIN, Call, Lowering, Params, Static, Variant, meta, over_rows, over_tokens


@dataclass(frozen=True)
class RopeStatic(Static):
    rows: int  # rows a token (heads)
    d: int


def _rope(x: torch.Tensor, positions: torch.Tensor, attrs: dict, config: dict) -> torch.Tensor:
    rope_dim = attrs["rope_dim"]
    return rope.rope(x, positions, _freqs_on(attrs["params"], rope_dim, x.device),
                     magnitude=inv_freq(attrs["params"], rope_dim)[1], inverse=attrs.get("inverse", False),
                     config=config)


class Rope(Lowering):
    template, ops, static_type, sources = "rope", ("rope",), RopeStatic, (rope,)

    def static(self, node: Node, params: Params) -> RopeStatic | None:
        t = node.inputs[0].type
        if not over_tokens(node) or any(not isinstance(s, int) for s in t.shape[1:]):
            return None
        rows = 1
        for s in t.shape[1:-1]:
            rows *= s
        return RopeStatic(rows, int(t.shape[-1]))

    def default_config(self, static: RopeStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return rope.default_config(static.rows, static.d)

    def run(self, call: Call) -> torch.Tensor:
        return _rope(call.args[0].contiguous(), call.ctx.positions, call.attrs, call.config)

    def trace(self, call: Call) -> None:
        m = call.tokens
        _rope(meta(m, call.static.rows, call.static.d), meta(m, dtype=torch.int64), call.attrs, call.config)


class RopeEntries(Rope):
    """dsl.ops.rope.rope_entries on the rope kernel, positions made once per layout of entries."""

    ops, ragged = ("rope_entries",), True

    def static(self, node: Node, params: Params) -> RopeStatic | None:
        t = node.inputs[0].type
        if not over_rows(node) or t.rank != 2 or not isinstance(t.shape[-1], int):
            return None
        return RopeStatic(1, int(t.shape[-1]))

    def run(self, call: Call) -> Ragged:
        x, ctx, ratio = call.args[0], call.ctx, call.attrs["ratio"]
        if isinstance(x, StaticEntries):  # a static step's (dsl/ops/static_entries.py): its rows' entries
            return x.replace(_rope(x.values.contiguous(), entry_positions(x.step, ratio), call.attrs, call.config))
        if not x.values.shape[0]:
            return x
        key = ("entry positions", ratio, tuple(x.first), tuple(x.counts))
        positions = ctx.memo(key, lambda: ctx.entry_layout(x.first, x.counts)[3] * ratio)
        return x.replace(_rope(x.values.contiguous(), positions, call.attrs, call.config))

    def trace(self, call: Call) -> None:
        m = call.tokens
        _rope(meta(m, call.static.d), meta(m, dtype=torch.int64), call.attrs, call.config)


ROPE, ROPE_ENTRIES = Rope(), RopeEntries()
LOWERINGS = (ROPE, ROPE_ENTRIES)

__all__ = ["LOWERINGS", "ROPE", "ROPE_ENTRIES", "RopeStatic"]
