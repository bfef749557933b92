"""What the batch-invariant references share: padded GEMM rows and the elementwise functions whose bits do not follow
a tensor's size. Each op's own batch-invariant reference sits beside the op (registered with `registry.invariant`).

A request's logits must be bitwise the same alone or in any batch, however its prompt is chunked. The references
below are written from what this build's torch does on the CPU (torch 2.13, MKL sgemm, AVX-512;
tests/test_engine_batch_invariance.py re-checks every claim):
- a GEMM row's result is the same for every row count from 12 on and at 4 and 8 (wherever the row sits), and differs
  at 1 to 3, 5 to 7, 9 to 11 (a GEMV, and kernels for the remainder rows); a column's is the same for every column
  count from 12 on. So the GEMMs inside ops get zero rows added up to a multiple of 4 below 12 (`padded_rows`), and
  the linears and the GEMMs over a sequence's cache at least `MIN_COLS` columns;
- `bmm` gives each batch element the same result whatever the batch count, the bits of that element's `mm`;
- in `mm(W, B)` a row of W gives the same result whatever rows are stacked around it (12 or more in all), and a
  column of B whether B is a transposed view or laid out as it is (the stacked experts, `moe.py`);
- elementwise kernels round an element alike wherever it sits, except sigmoid, silu and softplus (and exp2), whose
  vector and scalar-tail paths differ: an element's bits depend on the tensor's size. Softmax over a dim other than
  the last does too, unless the inner size is a multiple of 64. Inside the ops that use them these are computed from
  exp, log1p, max, sum and division (`InvariantElementwise`), which agree on both paths.
Everything else in the model (norms, softmax over a fixed dim, reductions over a fixed inner dim, elementwise ops,
`hc_expand`'s bmm) is invariant as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ClassVar

import torch
from torch.overrides import TorchFunctionMode

from dsl.ragged import Ragged
from dsl.scalar import operand

ROW_QUANTUM, FREE_ROWS = 4, 12
MIN_COLS = 16


def padded_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs with: itself from FREE_ROWS on, else the next ROW_QUANTUM multiple."""
    return rows if rows >= FREE_ROWS else max(ROW_QUANTUM, -(-rows // ROW_QUANTUM) * ROW_QUANTUM)


def pad_rows(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """x [n, ...] with zero rows appended up to `rows` (default: `padded_rows(n)`)."""
    rows = padded_rows(x.shape[0]) if rows is None else rows
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, _zeros((rows - x.shape[0], *x.shape[1:]), x.dtype, x.device)])


@functools.lru_cache(maxsize=256)
def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of `shape`, made once: padding rows, only ever read (copied by the `cat` that pads); a normal
    tensor even when first asked for under inference mode, so autograd code may read it too."""
    with torch.inference_mode(False):
        return torch.zeros(shape, dtype=dtype, device=device)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)): 1 / t is torch's reciprocal of t times 1, which is exact."""
    return torch.reciprocal(_one_plus(torch.exp(-x)))


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return x / _one_plus(torch.exp(-x))


def _one_plus(t: torch.Tensor) -> torch.Tensor:
    """1 + t for a fresh result t: in place unless autograd needs t (exp's backward reads its output), with 1 as a
    float32 tensor where t is float32 (dsl/scalar.py)."""
    one = operand(1.0, t)
    return t + one if t.requires_grad else t.add_(one)


def _softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    return torch.where(x * beta > threshold, x, torch.log1p(torch.exp(x * beta)) / beta)


def _sum(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`sum`; on a GPU over one dim, in a fixed order: a tree of elementwise adds (zeros padding the dim to a power
    of two add exactly). CUDA's reduction kernels split a row's sum by how many rows there are, so a row's bits
    would follow the batch; the CPU's reductions over the last dim are invariant as they are."""
    if x.device.type == "cpu" or not isinstance(dim, int):
        return torch.sum(x, dim, keepdim, dtype=dtype) if dim is not None else torch.sum(x, dtype=dtype)
    x = (x if dtype is None else x.to(dtype)).movedim(dim, -1)
    width = 1 << max(0, x.shape[-1] - 1).bit_length()
    x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x.movedim(-1, dim) if keepdim else x.squeeze(-1)


def _mean(x: torch.Tensor, dim=None, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`mean` through `_sum`."""
    if x.device.type == "cpu" or not isinstance(dim, int):
        return torch.mean(x, dim, keepdim, dtype=dtype) if dim is not None else torch.mean(x, dtype=dtype)
    return _sum(x, dim, keepdim, dtype=dtype) / x.shape[dim]


def softmax(x: torch.Tensor, dim: int, dtype: torch.dtype | None = None, **kwargs) -> torch.Tensor:
    x = x if dtype is None else x.to(dtype)
    e = torch.exp(x - x.amax(dim, keepdim=True))
    return e / _sum(e, dim, keepdim=True)


class InvariantElementwise(TorchFunctionMode):
    """Within it, sigmoid, silu, softplus and softmax are computed from functions whose bits do not depend on the
    tensor's size, and on a GPU sums and means over a dim in a fixed order (`_sum`)."""

    REPLACEMENTS: ClassVar[dict[Callable, Callable]] = {
        torch.sigmoid: sigmoid, torch.Tensor.sigmoid: sigmoid, torch.nn.functional.silu: silu,
        torch.nn.functional.softplus: _softplus, torch.softmax: softmax, torch.Tensor.softmax: softmax,
        torch.nn.functional.softmax: softmax, torch.sum: _sum, torch.Tensor.sum: _sum, torch.mean: _mean,
        torch.Tensor.mean: _mean,
    }

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.REPLACEMENTS.get(func, func)(*args, **(kwargs or {}))


def padded(reference: Callable, pad: bool = True) -> Callable:
    """`reference` under InvariantElementwise, on its first input padded by `pad_rows` (when `pad`); outputs cut back
    to the real rows. Over compressed entries (a `Ragged`), on their rows."""

    def run(x, *args, **kwargs):
        if isinstance(x, Ragged):
            return x.replace(run(x.values, *args, **kwargs))
        with InvariantElementwise():
            out = reference(pad_rows(x) if pad else x, *args, **kwargs)
        if not pad:
            return out
        return tuple(o[: x.shape[0]] for o in out) if isinstance(out, tuple) else out[: x.shape[0]]

    return run


__all__ = ["FREE_ROWS", "MIN_COLS", "ROW_QUANTUM", "InvariantElementwise", "pad_rows", "padded", "padded_rows",
           "sigmoid", "silu", "softmax"]
