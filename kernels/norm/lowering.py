"""The RMSNorm's lowering: TileLang's kernel (rms_norm_tilelang.py) or Triton's (rms_norm.py), as the target's
backends and this machine say (`Variant.backend`); over tokens or over the compressed entries of a forward. Where a
plan with fp8 activations has only fp8-activation linears read a norm, the norm writes e4m3 rows for them (e4m3.py;
`Variant.e4m3_out`): the fused rounding is Triton's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.norm.e4m3 as e4m3
import kernels.norm.rms_norm as rms_norm
import kernels.norm.rms_norm_tilelang as rms_norm_tilelang
from dsl.graph import Node
from kernels.lowering import PLAIN, TILELANG, TRITON, Call, Lowering, Params, Static, Variant, meta, over_rows, param


@dataclass(frozen=True)
class NormStatic(Static):
    d: int
    has_w: bool
    eps: float


def _module(variant: Variant):
    return rms_norm_tilelang if variant.backend == TILELANG else rms_norm


class RmsNorm(Lowering):
    template, ops, static_type = "rms_norm", ("rms_norm",), NormStatic
    sources, backends, writes_e4m3 = (rms_norm, rms_norm_tilelang), (TILELANG, TRITON), True

    def static(self, node: Node, params: Params) -> NormStatic | None:
        if not over_rows(node) or (node.inputs[1] is not None and param(node, 1, params) is None):
            return None
        return NormStatic(int(node.inputs[0].type.shape[-1]), node.inputs[1] is not None, node.attrs["eps"])

    def formats(self, static: NormStatic) -> dict[int, str]:
        return {1: "fp32"}

    def default_config(self, static: NormStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return _module(variant).default_config(static.d)

    def run(self, call: Call) -> torch.Tensor:
        return self._norm(call, call.args[0].contiguous(), call.args[1])

    def trace(self, call: Call) -> None:
        d = call.static.d
        self._norm(call, meta(call.tokens, d), meta(d) if call.static.has_w else None)

    @staticmethod
    def _norm(call: Call, x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        eps = call.static.eps
        if call.variant.e4m3_out:
            return e4m3.rms_norm_e4m3(x, w, eps=eps, config=call.config)
        return _module(call.variant).rms_norm(x, w, eps=eps, config=call.config)


RMS_NORM = RmsNorm()
LOWERINGS = (RMS_NORM,)

__all__ = ["LOWERINGS", "RMS_NORM", "NormStatic"]
