"""Per-token dense ops: embedding, linear over plain and block-quantised weights, grouped linear, RMSNorm; the
linears' batch-invariant references."""

from __future__ import annotations

import torch

from dsl.context import cast
from dsl.ops.invariant import MIN_COLS, pad_rows
from dsl.ops.registry import invariant, op, same_as_first
from dsl.ragged import Ragged, ragged_map
from dsl.scalar import f32
from dsl.tensor import TensorType


def weight_values(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The fp32 values of a stored weight: plain float, fp8 32x32 blocks or packed fp4 with per-32 scales."""
    if scale is None:
        return cast(w, torch.float32)
    from dsl.quant import dequantize

    return dequantize(w, scale)


def _embedding_type(ids: TensorType, table: TensorType) -> tuple[TensorType]:
    return (TensorType((*ids.shape, table.shape[-1]), "float32"),)


@op("embedding", _embedding_type)
def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rows of `table` [V, D] for integer `ids` [...] -> fp32 [..., D]."""
    return table[ids.long()].float()


def _linear_type(x: TensorType, w: TensorType, scale: TensorType | None = None) -> tuple[TensorType]:
    return (TensorType((*x.shape[:-1], w.shape[0]), "float32"),)


@op("linear", _linear_type)
@ragged_map
def linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., I] @ W.T with W [O, I] (plain, or fp8/fp4 with `scale`) -> fp32 [..., O]."""
    return torch.nn.functional.linear(x.float(), weight_values(w, scale))


def _grouped_type(x: TensorType, w: TensorType, scale: TensorType | None = None, *, groups: int) -> tuple[TensorType]:
    return (TensorType((*x.shape[:-1], w.shape[0]), "float32"),)


@op("grouped_linear", _grouped_type)
def grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *, groups: int) -> torch.Tensor:
    """Block-diagonal linear: x [N, G*K] split in G groups, group g through rows g*R..(g+1)*R-1 of W [G*R, K].

    Returns fp32 [N, G*R]: the groups' outputs concatenated.
    """
    wv = weight_values(w, scale).reshape(groups, -1, w.shape[-1])  # [G, R, K]
    xg = cast(x, torch.float32).reshape(x.shape[0], groups, -1)  # [N, G, K]
    return torch.bmm(xg.transpose(0, 1), wv.transpose(1, 2)).transpose(0, 1).reshape(x.shape[0], -1)  # "ngk,grk->ngr"


@invariant("linear")
def invariant_linear(x, w: torch.Tensor, scale: torch.Tensor | None = None):
    """`linear` as W @ x^T over at least MIN_COLS token columns (a column's result is the same for every column count
    from 12 on, dsl/ops/invariant.py): x [..., I] (or Ragged) -> fp32 [..., O]."""
    if isinstance(x, Ragged):
        return x.replace(invariant_linear(x.values, w, scale))
    rows = cast(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), torch.float32)  # [R, I]
    out = torch.mm(weight_values(w, scale), pad_rows(rows, max(MIN_COLS, rows.shape[0])).t())  # [O, >= R]
    out = out.t()[: rows.shape[0]].contiguous()  # [R, O]
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], w.shape[0])


@invariant("grouped_linear")
def invariant_grouped_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, *,
                             groups: int) -> torch.Tensor:
    """`grouped_linear` over rows padded as for a linear (its bmm has no size-dependent elementwise function)."""
    return grouped_linear(pad_rows(x), w, scale, groups=groups)[: x.shape[0]]


def _norm_type(x: TensorType, w: TensorType | None = None, **attrs) -> tuple[TensorType]:
    return (TensorType(x.shape, "float32"),)


@op("rms_norm", _norm_type)
@ragged_map
def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim, in fp32; no weight when `w` is None."""
    x = cast(x, torch.float32)
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + f32(eps))
    return y if w is None else cast(w, torch.float32) * y


@op("reshape", lambda x, *, shape: (TensorType(tuple(x.shape[:1]) + tuple(shape), x.dtype),))
def reshape(x: torch.Tensor, *, shape: tuple[int, ...]) -> torch.Tensor:
    """Reshape every token's trailing dims: x [N, ...] -> [N, *shape]."""
    return x.reshape(x.shape[0], *shape)


@op("add", same_as_first)
def add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


def _concat_type(*xs: TensorType) -> tuple[TensorType]:
    return (TensorType((*xs[0].shape[:-1], sum(x.shape[-1] for x in xs)), "float32"),)


@op("concat", _concat_type)
def concat(*xs: torch.Tensor) -> torch.Tensor:
    """Each token's vectors side by side: [N, D_1], [N, D_2], ... -> fp32 [N, D_1 + D_2 + ...]."""
    return torch.cat([x.float() for x in xs], dim=-1)


@op("stack", lambda *xs: (TensorType((xs[0].shape[0], len(xs), *xs[0].shape[1:]), "float32"),))
def stack(*xs: torch.Tensor) -> torch.Tensor:
    """k values of one shape per token stacked along a new dim 1: [N, ...] x k -> fp32 [N, k, ...]."""
    return torch.stack([x.float() for x in xs], dim=1)


@op("broadcast_streams", lambda x, *, copies: (TensorType((x.shape[0], copies, *x.shape[1:]), x.dtype),))
def broadcast_streams(x: torch.Tensor, *, copies: int) -> torch.Tensor:
    """Copy each token's vector into `copies` residual streams: [N, D] -> [N, copies, D]."""
    return x.unsqueeze(1).expand(-1, copies, *x.shape[1:]).contiguous()


@op("select_rows", lambda x: (x.with_shape(*x.shape),), uses_context=True)
def select_rows(x: torch.Tensor, *, ctx) -> torch.Tensor:
    """Keep the token rows the forward wants logits for (`ctx.logit_rows`; all when None)."""
    return x if ctx.logit_rows is None else x[ctx.logit_rows]


__all__ = ["embedding", "linear", "grouped_linear", "invariant_linear", "rms_norm", "reshape", "add", "concat", "stack",
           "broadcast_streams", "same_as_first"]
