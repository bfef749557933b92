"""Mixture of experts: the gate (sqrtsoftplus scores, biased top-k selection) and clamped SwiGLU experts; their
batch-invariant references."""

from __future__ import annotations

import torch

from dsl.ops.dense import invariant_linear, weight_values
from dsl.ops.invariant import padded, silu
from dsl.ops.registry import invariant, op
from dsl.tensor import TensorType


def score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    if func == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


def _gate_type(x: TensorType, w: TensorType, bias: TensorType, *, topk: int, **attrs) -> tuple[TensorType, ...]:
    return TensorType((x.shape[0], topk)), TensorType((x.shape[0], topk), "int64")


def gate_topk(logits: torch.Tensor, bias: torch.Tensor, *, topk: int, func: str, temp: float, normalize: bool,
              scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate after its projection (kernels/moe/gate.py's reference): logits fp32 [N, E] and bias [E] ->
    weights fp32 [N, k], experts int64 [N, k] (descending score + bias)."""
    scores = score(logits / temp, func)  # [N, E]
    experts = (scores + bias.float()).topk(topk, dim=-1)[1]
    weights = scores.gather(1, experts)
    if normalize and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


@op("moe_gate", _gate_type, num_outputs=2)
def moe_gate(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, *, topk: int, func: str, temp: float,
             normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Route x [N, D] with gate w [E, D]: pick the top-k of score + bias, weight by the unbiased scores
    (renormalised when `normalize`, then times `scaling`). Returns weights fp32 [N, k], experts int64 [N, k]."""
    return gate_topk(torch.nn.functional.linear(x.float(), w.float()), bias, topk=topk, func=func, temp=temp,
                     normalize=normalize, scaling=scaling)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), no clamps when `limit` is 0: an expert's activation."""
    if limit > 0:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    return torch.nn.functional.silu(gate) * up


def swiglu_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit)) on fp32 weights; `weight` [T, 1] scales the inner."""
    inner = clamped_swiglu(torch.nn.functional.linear(x, w1), torch.nn.functional.linear(x, w3), limit)
    if weight is not None:
        inner = weight * inner
    return torch.nn.functional.linear(inner, w2)


@op("swiglu", lambda x, *rest, **a: (TensorType(x.shape),))
def swiglu(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, s1: torch.Tensor | None = None,
           s2: torch.Tensor | None = None, s3: torch.Tensor | None = None, *, limit: float) -> torch.Tensor:
    """One clamped SwiGLU expert (the shared expert): x [N, D] -> fp32 [N, D]."""
    return swiglu_expert(x.float(), weight_values(w1, s1), weight_values(w2, s2), weight_values(w3, s3), limit)


@op("moe_experts", lambda x, *rest, **a: (TensorType(x.shape),))
def moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                w3: torch.Tensor, s1: torch.Tensor | None = None, s2: torch.Tensor | None = None,
                s3: torch.Tensor | None = None, *, limit: float) -> torch.Tensor:
    """sum over a token's chosen experts of weight * expert(x), experts stacked w1/w3 [E, I, D], w2 [E, D, I].

    Experts run in ascending id and add into an fp32 accumulator, as the reference does. x [N, D] -> [N, D].
    """
    return _sum_experts(swiglu_expert, x, weights, experts, ((w1, s1), (w2, s2), (w3, s3)), limit)


def _sum_experts(expert, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, stored: tuple,
                 limit: float) -> torch.Tensor:
    """sum over each token's chosen experts of weight * expert(x), experts in ascending id, into fp32; `stored`: the
    (weight, scale) of w1, w2, w3."""
    x = x.float()
    y = torch.zeros_like(x)
    for e in torch.unique(experts).tolist():
        rows, slot = torch.where(experts == e)
        w = [weight_values(m[e], None if s is None else s[e]) for m, s in stored]
        y[rows] += expert(x[rows], *w, limit, weights[rows, slot, None])
    return y


invariant("moe_gate")(padded(moe_gate))


def invariant_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
                     weight: torch.Tensor | None = None) -> torch.Tensor:
    """`swiglu_expert` with `invariant_linear` and the invariant silu."""
    gate, up = invariant_linear(x, w1), invariant_linear(x, w3)
    if limit > 0:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    inner = silu(gate) * up
    return invariant_linear(inner if weight is None else weight * inner, w2)


@invariant("swiglu")
def invariant_swiglu(x: torch.Tensor, w1, w2, w3, s1=None, s2=None, s3=None, *, limit: float) -> torch.Tensor:
    return invariant_expert(x.float(), weight_values(w1, s1), weight_values(w2, s2), weight_values(w3, s3), limit)


@invariant("moe_experts")
def invariant_moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1, w2, w3, s1=None, s2=None,
                          s3=None, *, limit: float) -> torch.Tensor:
    """An expert sees 1 to N rows as the batch goes, each row alike."""
    return _sum_experts(invariant_expert, x, weights, experts, ((w1, s1), (w2, s2), (w3, s3)), limit)
