"""The hyper-connections' lowerings: the mixes (Sinkhorn), collapse + RMSNorm (TileLang's kernel, collapse_tilelang.py,
or Triton's, as the target's backends and this machine say; written as e4m3 rows where only fp8-activation linears
read it, kernels/norm/e4m3.py), and the stream update, alone or over the sum of a sub-layer's two outputs, or made
inside the next mixes' first launch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.hyper.collapse_tilelang as collapse_tilelang
import kernels.hyper.hyper as hyper
import kernels.hyper.mixes as mixes
import kernels.norm.e4m3 as e4m3
from dsl.graph import Node
from kernels.lowering import (
    PLAIN,
    TILELANG,
    TRITON,
    Call,
    Lowering,
    Params,
    Static,
    Variant,
    meta,
    token_planes,
    traced_counts,
)

# where an op's streams [N, hc, D] come in (else first)
STREAMS_INPUT = {"hc_expand": 1, "add_hc_expand": 2, "hc_expand_mixes": 1, "add_hc_expand_mixes": 2}
DECODE_TOKENS = 64  # buckets up to here are decode buckets (`mixes.mixes_config`); the smallest serves one token


@dataclass(frozen=True)
class StreamsStatic(Static):
    """Streams [N, hc, d]."""

    hc: int
    d: int


class _Streams(Lowering):
    static_type = StreamsStatic
    sources = (hyper,)

    def static(self, node: Node, params: Params) -> StreamsStatic | None:
        planes = token_planes(node.inputs[STREAMS_INPUT.get(node.op, 0)].type)
        return None if planes is None else StreamsStatic(*planes)

    def default_config(self, static: StreamsStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return {}


class HcMixes(_Streams):
    template, ops, sources = "hc_mixes", ("hc_mixes",), (mixes,)

    def formats(self, static: StreamsStatic) -> dict[int, str]:
        return {1: "fp32", 2: "fp32", 3: "fp32"}

    def default_config(self, static: StreamsStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return mixes.mixes_config(tokens, static.hc * static.d)

    def invariant(self, config: dict) -> dict:
        """One token in two launches too (`one_launch` False), the kernels of every other count."""
        return dict(config, one_launch=False)

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, fn, scale, base = call.args
        return self._mixes(call, h.contiguous(), fn, scale, base)

    def trace(self, call: Call) -> None:
        """The bucket's launches, and under a decode bucket's config one token's too where its mixes run as one
        launch (`mixes.one_launch`), another kernel."""
        hc, d = call.static.hc, call.static.d
        nout = (2 + hc) * hc
        one = call.tokens <= DECODE_TOKENS and mixes.one_launch(1, call.config)
        for m in traced_counts(call.tokens, one):
            self._mixes(call, meta(m, hc, d), meta(nout, hc * d), meta(3), meta(nout))

    @staticmethod
    def _mixes(call: Call, h, fn, scale, base) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        a = call.attrs
        return mixes.hc_mixes(h, fn, scale, base, iters=a["iters"], eps=a["eps"], norm_eps=a["norm_eps"],
                              config=call.config)


@dataclass(frozen=True)
class UpdateStatic(StreamsStatic):
    """Streams [N, hc, d] updated from one sub-layer output, or (`add`) from the sum of two."""

    add: bool


class HcUpdateMixes(HcMixes):
    """`hc_expand_mixes` and `add_hc_expand_mixes`: the stream update made inside the next mixes' first launch
    (`mixes.hc_update_mixes`); the mixes' configs."""

    template, ops, static_type = "hc_update_mixes", ("hc_expand_mixes", "add_hc_expand_mixes"), UpdateStatic

    def static(self, node: Node, params: Params) -> UpdateStatic | None:
        planes = token_planes(node.inputs[STREAMS_INPUT[node.op]].type)
        return None if planes is None else UpdateStatic(*planes, add=node.op == "add_hc_expand_mixes")

    def formats(self, static: UpdateStatic) -> dict[int, str]:
        first = 5 if static.add else 4  # fn, scale and base follow y (or a and b), h, post and comb
        return {first: "fp32", first + 1: "fp32", first + 2: "fp32"}

    def run(self, call: Call) -> tuple[torch.Tensor, ...]:
        args = [t.contiguous() for t in call.args]
        if not call.static.add:
            args.insert(1, None)
        return self._update(call, *args)

    def trace(self, call: Call) -> None:
        st = call.static
        nout = (2 + st.hc) * st.hc
        one = call.tokens <= DECODE_TOKENS and mixes.one_launch(1, call.config)
        for m in traced_counts(call.tokens, one):
            self._update(call, meta(m, st.d), meta(m, st.d) if st.add else None, meta(m, st.hc, st.d),
                         meta(m, st.hc), meta(m, st.hc, st.hc), meta(nout, st.hc * st.d), meta(3), meta(nout))

    @staticmethod
    def _update(call: Call, a, b, h, post, comb, fn, scale, base) -> tuple[torch.Tensor, ...]:
        at = call.attrs
        return mixes.hc_update_mixes(a, b, h, post, comb, fn, scale, base, iters=at["iters"], eps=at["eps"],
                                     norm_eps=at["norm_eps"], config=call.config)


class HcCollapseRmsNorm(_Streams):
    template, ops = "hc_collapse_rms_norm", ("hc_collapse_rms_norm",)
    sources, backends, writes_e4m3 = (hyper, collapse_tilelang), (TILELANG, TRITON), True

    def formats(self, static: StreamsStatic) -> dict[int, str]:
        return {2: "fp32"}

    def default_config(self, static: StreamsStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return collapse_tilelang.default_config(static.d) if variant.backend == TILELANG else {}

    def run(self, call: Call) -> torch.Tensor:
        h, pre, w = call.args[0].contiguous(), call.args[1], call.args[2]
        if pre.dim() == 1:  # the first site's one-hot `hc_stream0` [hc], the same for every token
            pre = pre.float().expand(h.shape[0], -1)
        return self._collapse(call, h, pre.contiguous(), w)

    def trace(self, call: Call) -> None:
        st, m = call.static, call.tokens
        self._collapse(call, meta(m, st.hc, st.d), meta(m, st.hc), meta(st.d))

    @staticmethod
    def _collapse(call: Call, h, pre, w) -> torch.Tensor:
        eps = call.attrs["eps"]
        if call.variant.e4m3_out:
            return e4m3.hc_collapse_rms_norm_e4m3(h, pre, w, eps=eps)
        if call.variant.backend == TILELANG:
            return collapse_tilelang.hc_collapse_rms_norm(h, pre, w, eps=eps, config=call.config)
        return hyper.hc_collapse_rms_norm(h, pre, w, eps=eps)


class HcExpand(_Streams):
    template, ops = "hc_expand", ("hc_expand",)

    def run(self, call: Call) -> torch.Tensor:
        return hyper.hc_expand(*(a.contiguous() for a in call.args))

    def trace(self, call: Call) -> None:
        st, m = call.static, call.tokens
        hyper.hc_expand(meta(m, st.d), meta(m, st.hc, st.d), meta(m, st.hc), meta(m, st.hc, st.hc))


class HcAddExpand(_Streams):
    """`add_hc_expand`: the stream update over the sum of a sub-layer's two outputs, summed in the same launch."""

    template, ops = "hc_add_expand", ("add_hc_expand",)

    def run(self, call: Call) -> torch.Tensor:
        return hyper.hc_add_expand(*(a.contiguous() for a in call.args))

    def trace(self, call: Call) -> None:
        st, m = call.static, call.tokens
        hyper.hc_add_expand(meta(m, st.d), meta(m, st.d), meta(m, st.hc, st.d), meta(m, st.hc), meta(m, st.hc, st.hc))


HC_MIXES, HC_UPDATE_MIXES, HC_COLLAPSE_RMS_NORM = HcMixes(), HcUpdateMixes(), HcCollapseRmsNorm()
HC_EXPAND, HC_ADD_EXPAND = HcExpand(), HcAddExpand()
LOWERINGS = (HC_MIXES, HC_UPDATE_MIXES, HC_COLLAPSE_RMS_NORM, HC_EXPAND, HC_ADD_EXPAND)

__all__ = ["HC_ADD_EXPAND", "HC_COLLAPSE_RMS_NORM", "HC_EXPAND", "HC_MIXES", "HC_UPDATE_MIXES", "LOWERINGS",
           "StreamsStatic", "UpdateStatic"]
