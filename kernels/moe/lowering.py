"""The MoE family's lowerings: the routed experts (experts.py, fp4 or float weights) and the gate (`moe_gate`: its
projection on the linear family's decode GEMM in fp32 products, as the reference, since routing is discrete, one
token on its one-row kernel outside batch-invariant configs; then its scores and top-k on gate.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

import kernels.linear.linear as linear
import kernels.moe.experts as experts
import kernels.moe.fragments as fragments
import kernels.moe.gate as gate
from dsl.graph import Node
from kernels.linear.lowering import DECODE, no_gemv, one_row, weight_format
from kernels.lowering import (
    PLAIN,
    Call,
    Lowering,
    Params,
    Static,
    Variant,
    meta,
    over_tokens,
    param,
    traced_counts,
    weight_dtype,
)
from kernels.moe.expert_parallel_kernel import ConfigFor, ParallelMoeKernel, serve_pairs, wire_splits
from kernels.targets import Target


@dataclass(frozen=True)
class ExpertsStatic(Static):
    e: int  # experts
    inter: int
    d: int
    topk: int
    # "fp4" (packed codes, power-of-two scales per 32), "fp4_fragments" (the same codes in the order of the MMA's
    # register fragments: kernels/moe/fragments.py, on targets whose MMA takes it) | "plain"
    fmt: str


@dataclass(frozen=True)
class GateStatic(Static):
    e: int  # experts
    d: int


class MoeExperts(Lowering):
    template, ops, static_type, sources = "moe_experts", ("moe_experts",), ExpertsStatic, (experts, fragments)

    def static(self, node: Node, params: Params) -> ExpertsStatic | None:
        w1 = param(node, 3, params)
        if w1 is None or not over_tokens(node) or w1.dim() != 3:
            return None
        fp4 = w1.dtype == torch.uint8
        e, inter, k = w1.shape
        d = 2 * k if fp4 else k
        if not (fp4 or w1.is_floating_point()) or (fp4 and (d % 32 or inter % 32)):
            return None
        return ExpertsStatic(e, inter, d, int(node.inputs[2].type.shape[1]), "fp4" if fp4 else "plain")

    def whole(self, static: ExpertsStatic, expert_shards: int) -> ExpertsStatic:
        return replace(static, e=static.e * expert_shards)

    def on_target(self, static: ExpertsStatic, target: Target) -> ExpertsStatic:
        return replace(static, fmt="fp4_fragments") if static.fmt == "fp4" and target.mma_fragments else static

    def formats(self, static: ExpertsStatic) -> dict[int, str]:
        if static.fmt == "plain":
            return {3: "plain", 4: "plain", 5: "plain"}
        codes = "fragments" if static.fmt == "fp4_fragments" else "raw"
        return {3: codes, 4: codes, 5: codes, 6: "prescaled", 7: "prescaled", 8: "prescaled"}  # the bf16 factor

    def default_config(self, static: ExpertsStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return experts.default_config(tokens, static.fmt != "plain")

    def run(self, call: Call) -> torch.Tensor:
        x, weights, picks, w1, w2, w3, s1, s2, s3 = call.args
        return experts.moe_experts(x.contiguous(), weights.float().contiguous(), picks.contiguous(), w1, w2, w3, s1,
                                   s2, s3, limit=call.attrs["limit"], config=call.config, dot_fp32=call.dot_fp32)

    def invariant(self, config: dict) -> dict:
        """One token routed too (`unrouted` False), with the same kernels as every other count."""
        return dict(config, unrouted=False)

    def trace(self, call: Call) -> None:
        """The bucket's launches, and under a decode bucket's config one token's too where it runs unrouted
        (`experts.unrouted`: its GEMMs under other constexprs)."""
        st = call.static
        w1, w2, s1, s2 = self._meta_weights(call)
        one = call.tokens <= experts.DECODE_TOKENS and experts.unrouted(1, call.config)
        for m in traced_counts(call.tokens, one):
            experts.moe_experts(meta(m, st.d), meta(m, st.topk), meta(m, st.topk, dtype=torch.int64), w1, w2, w1, s1,
                                s2, s1, limit=call.attrs["limit"], config=call.config, dot_fp32=call.dot_fp32)

    def run_parallel(self, call: Call, kernel: ParallelMoeKernel, invariant: bool,
                     config_for: ConfigFor) -> torch.Tensor:
        """`run` under expert parallelism: the node's weights are this rank's experts, its pairs exchanged through
        `kernel` (kernels/moe/expert_parallel_kernel.py); `config_for(p)` the plan's config for p pairs."""
        x, weights, picks, w1, w2, w3, s1, s2, s3 = call.args
        return kernel(x.contiguous(), weights.float().contiguous(), picks.contiguous(), w1, w2, w3, s1, s2, s3,
                      limit=call.attrs["limit"], config_for=config_for, invariant=invariant, dot_fp32=call.dot_fp32)

    def trace_parallel(self, call: Call, invariant: bool) -> None:
        """The launches `run_parallel` adds to `trace`'s under the config of `call` (the batch-invariant one with
        `invariant`): the owner's GEMMs over arrived pairs (one a row), its sum of their splits outside
        batch-invariant mode, and the origin's sum of the partials that come back."""
        st, m = call.static, call.tokens
        w1, w2, s1, s2 = self._meta_weights(call)
        fp4 = st.fmt != "plain"
        rows = meta(m * st.topk, st.d, dtype=torch.float32 if call.dot_fp32 or not fp4 else torch.bfloat16)
        serve_pairs(rows, meta(m * st.topk, 1), meta(m * st.topk, 1, dtype=torch.int64), w1, w2, w1, s1, s2, s1,
                    limit=call.attrs["limit"], config=call.config, invariant=invariant, dot_fp32=call.dot_fp32)
        experts.sum_pairs(meta(m * st.topk, wire_splits(call.config, invariant), st.d), st.topk)

    @staticmethod
    def _meta_weights(call: Call) -> tuple:
        st = call.static
        if st.fmt == "plain":
            wd = weight_dtype(st.fmt, call.dot_fp32)
            return meta(st.e, st.inter, st.d, dtype=wd), meta(st.e, st.d, st.inter, dtype=wd), None, None
        if st.fmt == "fp4_fragments":
            w1 = meta(st.e, st.inter // 16, st.d // 32, fragments.UNIT, dtype=torch.uint8)
            w2 = meta(st.e, st.d // 16, st.inter // 32, fragments.UNIT, dtype=torch.uint8)
        else:
            w1 = meta(st.e, st.inter, st.d // 2, dtype=torch.uint8)
            w2 = meta(st.e, st.d, st.inter // 2, dtype=torch.uint8)
        s1 = meta(st.e, st.inter, st.d // 32, dtype=torch.bfloat16)
        s2 = meta(st.e, st.d, st.inter // 32, dtype=torch.bfloat16)
        return w1, w2, s1, s2


class MoeGate(Lowering):
    """The projection's config is the tuned one (the decode GEMM's, so its source keys the cache)."""

    template, ops, static_type, sources = "moe_gate", ("moe_gate",), GateStatic, (linear,)

    def static(self, node: Node, params: Params) -> GateStatic | None:
        w = param(node, 1, params)
        if not over_tokens(node) or weight_format(w, None) != "plain" or param(node, 2, params) is None:
            return None
        return GateStatic(w.shape[0], w.shape[1])

    def formats(self, static: GateStatic) -> dict[int, str]:
        return {1: "fp32", 2: "fp32"}

    def default_config(self, static: GateStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return linear.default_config(tokens, static.e, static.d, w_bytes=4)

    def invariant(self, config: dict) -> dict:
        return no_gemv(config)

    def run(self, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        x, w, bias = call.args
        return self._gate(x.contiguous(), w, bias, call)

    def trace(self, call: Call) -> None:
        st = call.static
        for rows in one_row(call.tokens, DECODE):  # the decode GEMM's projection: one token on the one-row kernel too
            self._gate(meta(rows, st.d), meta(st.e, st.d), meta(st.e), call)

    @staticmethod
    def _gate(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, call: Call) -> tuple[torch.Tensor, torch.Tensor]:
        kw = {k: call.attrs[k] for k in ("topk", "func", "temp", "normalize", "scaling")}
        if linear.on_one_row(x.shape[0], w, call.config, dot_fp32=True):
            return gate.gate_one_row(x, w, bias, **kw)  # the one-row projection and the top k in one launch
        return gate.gate_topk(linear.linear(x, w, config=call.config, dot_fp32=True), bias, **kw)


MOE_EXPERTS, MOE_GATE = MoeExperts(), MoeGate()
LOWERINGS = (MOE_EXPERTS, MOE_GATE)

__all__ = ["LOWERINGS", "MOE_EXPERTS", "MOE_GATE", "ExpertsStatic", "GateStatic"]
