"""Python numbers as float32 operands of float32 ops, made once.

torch wraps a Python number in a tensor at every call and, in a float32 op, converts it to float32 there (a copy
through `aten::to`: about as long as the op itself on the small tensors of a decode step). A 0-dim float32 CPU tensor
holding the number already rounded to float32 is the same operand: torch treats it as a CPU scalar in the same
kernels (on any device), so the results are bit for bit those of the Python number. Use it only against float32
tensors: against another dtype a float32 number would be rounded twice.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def f32(value: float) -> torch.Tensor:
    """`value` as a 0-dim float32 CPU tensor (a normal tensor even when first asked for under inference mode, so
    autograd code may read it too); never written."""
    with torch.inference_mode(False):
        return torch.tensor(value, dtype=torch.float32)


def operand(value: float, t: torch.Tensor) -> torch.Tensor | float:
    """`value` as the operand of an op on `t`: `f32(value)` where t is float32, else the Python number."""
    return f32(value) if t.dtype == torch.float32 else value


__all__ = ["f32", "operand"]
