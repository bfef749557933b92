"""The cache roundings' lowerings: values rounded onto the fp8 and fp4 grids of a cache format and back (rounding.py),
over tokens or compressed entries. A last dim that is not a multiple of the block runs the reference (which returns
x unchanged)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.rounding.rounding as rounding
from dsl.graph import Node
from kernels.lowering import PLAIN, Call, Lowering, Params, Static, Variant, meta, over_rows


@dataclass(frozen=True)
class Fp8RoundStatic(Static):
    d: int
    block: int  # values a scale


@dataclass(frozen=True)
class Fp4RoundStatic(Static):
    d: int
    block: int
    e4m3_scale: bool  # e4m3 scales, else powers of two


class _Rounding(Lowering):
    sources = (rounding,)

    def default_config(self, static, tokens: int, variant: Variant = PLAIN, gemms: tuple[str, ...] = ()) -> dict:
        return rounding.default_config(static.block)

    def run(self, call: Call) -> torch.Tensor:
        return self._round(call, call.args[0])

    def trace(self, call: Call) -> None:
        self._round(call, meta(call.tokens, call.static.d))

    @staticmethod
    def _block(node: Node) -> int | None:
        block = node.attrs.get("block", 32)  # fp8_round's default
        return None if not over_rows(node) or int(node.inputs[0].type.shape[-1]) % block else block


class Fp8Round(_Rounding):
    template, ops, static_type = "fp8_round", ("fp8_round",), Fp8RoundStatic

    def static(self, node: Node, params: Params) -> Fp8RoundStatic | None:
        block = self._block(node)
        return None if block is None else Fp8RoundStatic(int(node.inputs[0].type.shape[-1]), block)

    @staticmethod
    def _round(call: Call, x: torch.Tensor) -> torch.Tensor:
        return rounding.fp8_round(x.contiguous(), block=call.static.block, config=call.config)


class Fp4Round(_Rounding):
    template, ops, static_type = "fp4_round", ("fp4_round",), Fp4RoundStatic

    def static(self, node: Node, params: Params) -> Fp4RoundStatic | None:
        block = self._block(node)
        if block is None:
            return None
        return Fp4RoundStatic(int(node.inputs[0].type.shape[-1]), block, bool(node.attrs["e4m3_scale"]))

    @staticmethod
    def _round(call: Call, x: torch.Tensor) -> torch.Tensor:
        st = call.static
        return rounding.fp4_round(x.contiguous(), block=st.block, e4m3_scale=st.e4m3_scale, config=call.config)


FP8_ROUND, FP4_ROUND = Fp8Round(), Fp4Round()
LOWERINGS = (FP8_ROUND, FP4_ROUND)

__all__ = ["FP4_ROUND", "FP8_ROUND", "LOWERINGS", "Fp4RoundStatic", "Fp8RoundStatic"]
