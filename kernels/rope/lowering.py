"""The rotary embedding's lowerings: over the tokens (`rope`) and over the compressed entries a forward completes
(`rope_entries`: entry j of ratio r at position j * r), one kernel (rope.py) and template for both; and the same
fused with the cache rounding after them (`rope_fp8_round`, `rope_fp4_round`, `rope_entries_fp4_round`) and with the
RMS norm before that (`rms_norm_rope_fp8_round`, `rms_norm_rope_entries_fp4_round`): rope.py's `rope_round_kernel`,
template "rope_round"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.rope.rope as rope
from dsl.graph import Node
from dsl.ops.rope import _freqs_on, inv_freq
from dsl.ops.static_entries import StaticEntries, entry_positions
from dsl.ragged import Ragged
from kernels.lowering import PLAIN, Call, Lowering, Params, Static, Variant, meta, over_rows, over_tokens, param


@dataclass(frozen=True)
class RopeStatic(Static):
    rows: int  # rows a token (heads)
    d: int


@dataclass(frozen=True)
class RopeRoundStatic(RopeStatic):
    fp8: bool  # fp8_round, else fp4_round
    block: int  # values a scale; 0 where the dim is not a multiple of it (the reference's rounding returns x)
    e4m3_scale: bool  # fp4's scales e4m3, else powers of two
    norm: bool = False  # each row RMS-normed first (the rms_norm_* ops)
    has_w: bool = False  # ... times a weight
    eps: float = 0.0


def _rope(x: torch.Tensor, positions: torch.Tensor, call: Call, w: torch.Tensor | None = None) -> torch.Tensor:
    attrs, config, static, rope_dim = call.attrs, call.config, call.static, call.attrs["rope_dim"]
    freqs, magnitude = _freqs_on(attrs["params"], rope_dim, x.device), inv_freq(attrs["params"], rope_dim)[1]
    inverse = attrs.get("inverse", False)
    if not isinstance(static, RopeRoundStatic) or not (static.block or static.norm):
        return rope.rope(x, positions, freqs, magnitude=magnitude, inverse=inverse, config=config)
    return rope.rope_round(x, positions, freqs, fp8=static.fp8, block=static.block, e4m3_scale=static.e4m3_scale,
                           magnitude=magnitude, inverse=inverse, norm=static.norm, w=w, eps=static.eps, config=config)


def _rounded(static: RopeStatic | None, node: Node, params: Params) -> RopeRoundStatic | None:
    """`static` with the node's rounding (its op ends with fp8_round or fp4_round) and norm (it starts with rms_norm):
    None where the kernel cannot round in its blocks (a block that is not a power of two) or the norm's weight is no
    parameter."""
    if static is None:
        return None
    fp8, block = node.op.endswith("fp8_round"), int(node.attrs.get("block", 32))
    norm = node.op.startswith("rms_norm_")
    if static.d % block:
        block = 0  # the rounding returns x: rotated (and normed) only
    elif block & (block - 1):
        return None
    has_w = norm and node.inputs[1] is not None
    if has_w and param(node, 1, params) is None:
        return None
    return RopeRoundStatic(static.rows, static.d, fp8, block, not fp8 and bool(node.attrs["e4m3_scale"]), norm, has_w,
                           float(node.attrs["eps"]) if norm else 0.0)


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
        return _rope(call.args[0].contiguous(), call.ctx.positions, call, _weight(call))

    def trace(self, call: Call) -> None:
        m = call.tokens
        _rope(meta(m, call.static.rows, call.static.d), meta(m, dtype=torch.int64), call, _meta_weight(call))


class RopeEntries(Rope):
    """dsl.ops.rope.rope_entries on the rope kernel, positions made once per layout of entries."""

    ops, ragged = ("rope_entries",), True

    def static(self, node: Node, params: Params) -> RopeStatic | None:
        t = node.inputs[0].type
        if not over_rows(node) or t.rank != 2 or not isinstance(t.shape[-1], int):
            return None
        return RopeStatic(1, int(t.shape[-1]))

    def run(self, call: Call) -> Ragged:
        x, ctx, ratio, w = call.args[0], call.ctx, call.attrs["ratio"], _weight(call)
        if isinstance(x, StaticEntries):  # a static step's (dsl/ops/static_entries.py): its rows' entries
            return x.replace(_rope(x.values.contiguous(), entry_positions(x.step, ratio), call, w))
        if not x.values.shape[0]:
            return x
        key = ("entry positions", ratio, tuple(x.first), tuple(x.counts))
        positions = ctx.memo(key, lambda: ctx.entry_layout(x.first, x.counts)[3] * ratio)
        return x.replace(_rope(x.values.contiguous(), positions, call, w))

    def trace(self, call: Call) -> None:
        m = call.tokens
        _rope(meta(m, call.static.d), meta(m, dtype=torch.int64), call, _meta_weight(call))


def _has_w(call: Call) -> bool:
    return isinstance(call.static, RopeRoundStatic) and call.static.has_w


def _weight(call: Call) -> torch.Tensor | None:
    """The norm's weight of a normed rope_round node, else None."""
    return call.args[1] if _has_w(call) else None


def _meta_weight(call: Call) -> torch.Tensor | None:
    return meta(call.static.d) if _has_w(call) else None


class _Rounds:
    """What the fused ropes add to `Rope` and `RopeEntries`: the rounding (and norm) in their static, the norm's
    weight as fp32."""

    template, static_type = "rope_round", RopeRoundStatic

    def static(self, node: Node, params: Params) -> RopeRoundStatic | None:
        return _rounded(super().static(node, params), node, params)

    def formats(self, static: RopeRoundStatic) -> dict[int, str]:
        return {1: "fp32"} if static.has_w else {}


class RopeRound(_Rounds, Rope):
    """`rope_fp8_round`, `rope_fp4_round` and `rms_norm_rope_fp8_round`: the rope kernel rounding its rows in the same
    pass (and norming them first)."""

    ops = ("rope_fp8_round", "rope_fp4_round", "rms_norm_rope_fp8_round")


class RopeEntriesRound(_Rounds, RopeEntries):
    """`rope_entries_fp4_round` and `rms_norm_rope_entries_fp4_round`: the compressed entries rotated and rounded in
    one pass (and normed first)."""

    ops = ("rope_entries_fp4_round", "rms_norm_rope_entries_fp4_round")


ROPE, ROPE_ENTRIES, ROPE_ROUND, ROPE_ENTRIES_ROUND = Rope(), RopeEntries(), RopeRound(), RopeEntriesRound()
LOWERINGS = (ROPE, ROPE_ENTRIES, ROPE_ROUND, ROPE_ENTRIES_ROUND)

__all__ = ["LOWERINGS", "ROPE", "ROPE_ENTRIES", "ROPE_ENTRIES_ROUND", "ROPE_ROUND", "RopeRoundStatic", "RopeStatic"]
