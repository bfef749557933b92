"""Mixture of experts: the gate (sqrtsoftplus scores, biased top-k selection) and clamped SwiGLU experts; their
batch-invariant references."""

from __future__ import annotations

import torch

from dsl import native
from dsl.context import cast
from dsl.ops.dense import invariant_linear, weight_values
from dsl.ops.invariant import MIN_COLS, pad_rows, padded, silu
from dsl.ops.registry import invariant, op
from dsl.scalar import f32
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
    experts = (scores + cast(bias, torch.float32)).topk(topk, dim=-1)[1]
    weights = scores.gather(1, experts)
    if normalize and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


@op("moe_gate", _gate_type, num_outputs=2)
def moe_gate(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, *, topk: int, func: str, temp: float,
             normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Route x [N, D] with gate w [E, D]: pick the top-k of score + bias, weight by the unbiased scores
    (renormalised when `normalize`, then times `scaling`). Returns weights fp32 [N, k], experts int64 [N, k]."""
    logits = torch.nn.functional.linear(cast(x, torch.float32), cast(w, torch.float32))
    return gate_topk(logits, bias, topk=topk, func=func, temp=temp, normalize=normalize, scaling=scaling)


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


_padded_gate = padded(moe_gate)


@invariant("moe_gate")
def invariant_moe_gate(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, *, topk: int, func: str, temp: float,
                       normalize: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_gate` over rows padded as for a linear, its softplus computed from exp and log1p (`invariant.py`). For
    the sqrtsoftplus scores it is written out: the same operations as under InvariantElementwise, without the mode's
    dispatch on every call (times and divisions by 1.0, exact, left out)."""
    if func != "sqrtsoftplus":
        return _padded_gate(x, w, bias, topk=topk, func=func, temp=temp, normalize=normalize, scaling=scaling)
    logits = torch.nn.functional.linear(pad_rows(cast(x, torch.float32)), cast(w, torch.float32))
    if temp != 1.0:
        logits = logits / temp
    scores = torch.where(logits > f32(20.0), logits, torch.log1p(torch.exp(logits))).sqrt()  # [N', E]
    experts = (scores + cast(bias, torch.float32)).topk(topk, dim=-1)[1]
    weights = scores.gather(1, experts)
    if normalize and topk > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + f32(1e-20))
    return (weights * f32(scaling))[: x.shape[0]], experts[: x.shape[0]]


def invariant_expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
                    weight: torch.Tensor | None = None) -> torch.Tensor:
    """`swiglu_expert` with `invariant_linear` and the invariant silu."""
    gate, up = invariant_linear(x, w1), invariant_linear(x, w3)
    if limit > 0:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    inner = silu(gate) * up
    return invariant_linear(inner if weight is None else weight * inner, w2)


def _columns(x: torch.Tensor) -> torch.Tensor:
    """x [N, D] as the GEMMs' token columns: [D, max(MIN_COLS, N)], zero columns padding it (dsl/ops/invariant.py)."""
    return pad_rows(cast(x, torch.float32), max(MIN_COLS, x.shape[0])).t()


def _inner(w1: torch.Tensor, w3: torch.Tensor, columns: torch.Tensor, limit: float) -> torch.Tensor:
    """The clamped SwiGLU activations, transposed: W1 [M, D] and W3 over token columns [D, P] -> [M, P]."""
    gate, up = torch.mm(w1, columns), torch.mm(w3, columns)
    if limit > 0:
        up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
    return silu(gate) * up


@invariant("swiglu")
def invariant_swiglu(x: torch.Tensor, w1, w2, w3, s1=None, s2=None, s3=None, *, limit: float) -> torch.Tensor:
    """`invariant_expert` kept in the GEMMs' transposed layout from the first GEMM to the last: the same products
    (a GEMM's column does not follow the B operand's layout, dsl/ops/invariant.py)."""
    w1, w2, w3 = weight_values(w1, s1), weight_values(w2, s2), weight_values(w3, s3)
    out = torch.mm(w2, _inner(w1, w3, _columns(x), limit))  # [D, P]
    return out.t()[: x.shape[0]].contiguous()


@invariant("moe_experts")
def invariant_moe_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1, w2, w3, s1=None, s2=None,
                          s3=None, *, limit: float) -> torch.Tensor:
    """An expert sees 1 to N rows as the batch goes, each row alike. Plain weights run every expert in use over every
    token at once (`_stacked_experts`); quantised ones expert by expert."""
    if s1 is not None or s2 is not None or s3 is not None:
        return _sum_experts(invariant_expert, x, weights, experts, ((w1, s1), (w2, s2), (w3, s3)), limit)
    return _stacked_experts(x, weights, experts, cast(w1, torch.float32), cast(w2, torch.float32),
                            cast(w3, torch.float32), limit)


def _stacked_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     w3: torch.Tensor, limit: float) -> torch.Tensor:
    """`invariant_moe_experts` with the experts in use (every expert, when they are small) stacked: their W1 and W3
    rows in one GEMM each over every token's column, their W2 in one `bmm`, the outputs of the experts in use then
    added in ascending id. The bits are the expert by expert ones (dsl/ops/invariant.py): a GEMM row's result does not
    follow how many rows are stacked, a column's how many columns, a `bmm` element is that element's GEMM. A token an
    expert was not chosen for has weight 0 there: its column of that expert's output is zero, and adding it leaves
    the token's sum as it was (no sum is -0, the accumulator starting at +0)."""
    n, dim = x.shape
    used = sorted(set(experts.reshape(-1).tolist()))  # ascending
    columns = _columns(x)  # [D, P]
    dense = torch.zeros(columns.shape[1], w1.shape[0], device=x.device)
    dense[:n].scatter_(1, experts, cast(weights, torch.float32))  # [P, E]: each token's weight for each expert
    if len(used) < w1.shape[0] and w1.numel() > ALL_EXPERTS_VALUES:
        chosen = torch.tensor(used, device=x.device)
        w1, w2, w3, dense = w1[chosen], w2[chosen], w3[chosen], dense[:, chosen]
        used = list(range(len(used)))
    k, inner_dim = w1.shape[0], w1.shape[1]
    inner = _inner(w1.reshape(k * inner_dim, dim), w3.reshape(k * inner_dim, dim), columns, limit)  # [k * I, P]
    inner = dense.t()[:, None, :] * inner.view(k, inner_dim, -1)  # the routing weight times the activations
    out = torch.bmm(w2, inner).transpose(1, 2)[:, :n]  # [k, N, D]
    if (y := native.add_slices(out, used)) is not None:  # the same adds in C
        return y
    y = torch.zeros(n, dim, device=x.device)
    for j in used:
        y += out[j]
    return y


# Up to this many values in an expert stack (W1's), every expert runs rather than the ones in use gathered: the GEMMs
# of small experts cost less than the three gathers of their weights.
ALL_EXPERTS_VALUES = 1 << 18
