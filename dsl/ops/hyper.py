"""Hyper-connections: `hc` residual streams mixed by weights computed from the streams themselves."""

from __future__ import annotations

import numpy as np
import torch

from dsl import native
from dsl.context import cast
from dsl.derived import derived
from dsl.ops.dense import add, invariant_linear
from dsl.ops.invariant import sigmoid
from dsl.ops.registry import invariant, op
from dsl.scalar import f32, operand
from dsl.tensor import TensorType


def _mixes_type(h: TensorType, *rest, **attrs) -> tuple[TensorType, TensorType, TensorType]:
    n, hc = h.shape[0], h.shape[1]
    return TensorType((n, hc)), TensorType((n, hc)), TensorType((n, hc, hc))


@op("hc_mixes", _mixes_type, num_outputs=3)
def hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int, eps: float,
             norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From streams h [N, hc, D]: pre [N, hc], post [N, hc] and the doubly-stochastic comb [N, hc, hc].

    The flattened streams are RMS-normalised without a weight and projected by fn [(2 + hc) * hc, hc * D].
    """
    hc = h.shape[1]
    flat = h.reshape(h.shape[0], -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    m = torch.nn.functional.linear(flat, fn.float())
    scale, base = scale.float(), base.float()
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[:, 2 * hc :] * scale[2] + base[2 * hc :]).reshape(-1, hc, hc)
    return pre, post, doubly_stochastic(comb, iters, eps)


@invariant("hc_mixes")
def invariant_hc_mixes(h: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int,
                       eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_mixes` with its projection as `invariant_linear` and the invariant sigmoid. Written out rather than run
    under InvariantElementwise: the Sinkhorn loop's many small calls would each pay the mode's dispatch. The three
    scales multiply their columns as one vector (the same products), and one sigmoid covers pre and post: the invariant
    sigmoid rounds an element alike whatever the tensor's size."""
    hc = h.shape[1]
    flat = cast(h.reshape(h.shape[0], -1), torch.float32)  # [N, hc * D]
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True).add_(f32(norm_eps)))
    m = invariant_linear(flat, cast(fn, torch.float32))  # [N, (2 + hc) * hc]
    z = m * derived(scale, ("hc columns", hc), lambda: _column_scales(scale, hc)) + cast(base, torch.float32)
    gates = sigmoid(z[:, : 2 * hc])
    pre, post = gates[:, :hc] + f32(eps), gates[:, hc:] * f32(2.0)
    return pre, post, doubly_stochastic(z[:, 2 * hc :].reshape(-1, hc, hc), iters, eps)


def _column_scales(scale: torch.Tensor, hc: int) -> torch.Tensor:
    """fp32 [(2 + hc) * hc]: the scale of each column of the mixes, pre's hc (scale[0]), post's hc (scale[1]), comb's
    hc * hc (scale[2])."""
    columns = torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=scale.device)
    return cast(scale, torch.float32)[columns]


NUMPY_SINKHORN_ROWS = 32  # without the C loop: up to this many tokens numpy's per-call cost wins, above torch's


def doubly_stochastic(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [N, hc, hc] from its logits: softmax over the last dim, plus eps, then `sinkhorn` (in place on that sum,
    a fresh tensor, where the loop runs in C or numpy)."""
    return sinkhorn(torch.softmax(logits, dim=-1) + operand(eps, logits), iters, eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [N, hc, hc] (positive) made doubly stochastic: divided by its column sums plus eps, then `iters - 1`
    times by its row sums plus eps and by its column sums plus eps. On the CPU, in float32 and for hc up to
    native.MAX_HC (torch adds more values in another order), the same sums (added in torch's order) and divisions
    run in place in C (dsl/native.c) for any number of tokens; without a C compiler, in numpy up to
    NUMPY_SINKHORN_ROWS tokens, whose calls cost a fraction of torch's (the loop is 6 * iters small calls).
    tests/test_hyper_sinkhorn.py checks the bits of both."""
    if native.sinkhorn(comb, iters, eps):
        return comb  # the caller's fresh tensor, normalised in place
    if (comb.device.type != "cpu" or comb.dtype != torch.float32 or comb.shape[0] > NUMPY_SINKHORN_ROWS
            or not comb.is_contiguous() or comb.shape[1] > native.MAX_HC):
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return comb
    _numpy_sinkhorn(comb.numpy(), iters, eps)
    return comb


def _numpy_sinkhorn(a: np.ndarray, iters: int, eps: float) -> None:
    """`sinkhorn`'s loop on a float32 array [N, hc, hc], in place."""
    n, hc = a.shape[0], a.shape[1]
    rows, cols, e = np.empty((n, hc, 1), np.float32), np.empty((n, 1, hc), np.float32), np.float32(eps)
    add, divide, reduce = np.add, np.divide, np.add.reduce
    reduce(a, axis=1, keepdims=True, out=cols)
    add(cols, e, out=cols)
    divide(a, cols, out=a)
    for _ in range(iters - 1):
        reduce(a, axis=2, keepdims=True, out=rows)
        add(rows, e, out=rows)
        divide(a, rows, out=a)
        reduce(a, axis=1, keepdims=True, out=cols)
        add(cols, e, out=cols)
        divide(a, cols, out=a)


@op("hc_collapse", lambda h, pre: (TensorType((h.shape[0], h.shape[2])),))
def hc_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_k pre[:, k] * h[:, k]: streams [N, hc, D] -> [N, D]."""
    return (pre.unsqueeze(-1) * cast(h, torch.float32)).sum(dim=1)


@op("hc_mean", lambda h: (TensorType((h.shape[0], h.shape[2])),))
def hc_mean(h: torch.Tensor) -> torch.Tensor:
    """The mean of the streams [N, hc, D] -> fp32 [N, D] (what DSpark reads of a target layer)."""
    return h.float().mean(dim=1)


@op("hc_expand", lambda y, h, post, comb: (TensorType(h.shape),))
def hc_expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams: out[:, k] = post[:, k] * y + sum_j comb[:, j, k] * h[:, j]. y [N, D], h [N, hc, D]."""
    mixed = torch.bmm(cast(comb, torch.float32).transpose(1, 2), cast(h, torch.float32))  # einsum "njk,njd->nkd"
    return post.unsqueeze(-1) * cast(y, torch.float32).unsqueeze(1) + mixed


@op("add_hc_expand", lambda a, b, h, post, comb: (TensorType(h.shape),))
def add_hc_expand(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
    """`add` followed by `hc_expand`: a sub-layer's two outputs summed straight into the new streams (made by the
    fusion pass)."""
    return hc_expand(add(a, b), h, post, comb)


def _expand_mixes_type(*inputs: TensorType, **attrs) -> tuple[TensorType, ...]:
    h = inputs[-6]  # the streams: before post, comb, fn, scale, base
    return (TensorType(h.shape), *_mixes_type(h))


@op("hc_expand_mixes", _expand_mixes_type, num_outputs=4)
def hc_expand_mixes(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                    scale: torch.Tensor, base: torch.Tensor, *, iters: int, eps: float,
                    norm_eps: float) -> tuple[torch.Tensor, ...]:
    """`hc_expand`, then `hc_mixes` of the new streams: the new streams and their pre, post and comb (made by the
    fusion pass where the next mixes read the streams an update makes)."""
    streams = hc_expand(y, h, post, comb)
    return (streams, *hc_mixes(streams, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps))


@op("add_hc_expand_mixes", _expand_mixes_type, num_outputs=4)
def add_hc_expand_mixes(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                        fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int, eps: float,
                        norm_eps: float) -> tuple[torch.Tensor, ...]:
    """`add_hc_expand`, then `hc_mixes` of the new streams (as `hc_expand_mixes`)."""
    streams = add_hc_expand(a, b, h, post, comb)
    return (streams, *hc_mixes(streams, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps))


@invariant("hc_expand_mixes")
def invariant_hc_expand_mixes(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                              fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *, iters: int, eps: float,
                              norm_eps: float) -> tuple[torch.Tensor, ...]:
    """The update (invariant as it is), then `invariant_hc_mixes`."""
    streams = hc_expand(y, h, post, comb)
    return (streams, *invariant_hc_mixes(streams, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps))


@invariant("add_hc_expand_mixes")
def invariant_add_hc_expand_mixes(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
                                  comb: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, *,
                                  iters: int, eps: float, norm_eps: float) -> tuple[torch.Tensor, ...]:
    """The add and the update (invariant as they are), then `invariant_hc_mixes`."""
    streams = add_hc_expand(a, b, h, post, comb)
    return (streams, *invariant_hc_mixes(streams, fn, scale, base, iters=iters, eps=eps, norm_eps=norm_eps))


@op("hc_collapse_rms_norm", lambda h, pre, w, **a: (TensorType((h.shape[0], h.shape[2])),))
def hc_collapse_rms_norm(h: torch.Tensor, pre: torch.Tensor, w: torch.Tensor, *, eps: float) -> torch.Tensor:
    """hc_collapse followed by rms_norm, one pass over the streams (made by the fusion pass)."""
    x = hc_collapse(h, pre)
    return cast(w, torch.float32) * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + f32(eps)))
