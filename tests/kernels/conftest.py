"""Kernel tests: on CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py).

Triton 3.6's interpreter multiplies bfloat16 operands of `tl.dot` and of `*` as their raw uint16 bits, casts fp32 to
bf16 by truncation and widens subnormal bf16 wrongly (to zero, or to another value); the GPU does none of these. They
are patched here, for the tests only, so interpreted kernels compute what compiled ones do: bf16 dot operands, factors
and casts widened exactly to fp32, fp32 -> bf16 (and bf16 products) rounded to nearest even.

The interpreter's `tl.dot` is numpy's matmul, i.e. the host BLAS, whose result for one row of a block can depend on
where the row sits and on the block's other rows (how the library splits the block into its micro-kernels). The
batch-invariance tests take `row_independent_dot`, which computes a dot one row of the block at a time.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch


def _bf16_bits_to_f32(data: np.ndarray) -> np.ndarray:
    return (data.astype(np.uint32) << 16).view(np.float32)


def _patch_interpreter() -> None:
    import triton.language as tl
    from triton.runtime import interpreter as ti

    create_dot, cast_impl = ti.InterpreterBuilder.create_dot, ti.InterpreterBuilder.cast_impl
    create_fmul = ti.InterpreterBuilder.create_fmul

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return ti.TensorHandle(_bf16_bits_to_f32(h.data), tl.float32)
        return h

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return ti.TensorHandle(_bf16_bits_to_f32(src.data), tl.float32)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return ti.TensorHandle(bits.view(np.uint16), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    def fmul(self, lhs, rhs):
        if lhs.dtype.scalar != tl.bfloat16:
            return create_fmul(self, lhs, rhs)
        product = torch.from_numpy(np.ascontiguousarray(widen(lhs).data * widen(rhs).data)).to(torch.bfloat16)
        return ti.TensorHandle(product.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)

    ti.InterpreterBuilder.create_dot = dot
    ti.InterpreterBuilder.cast_impl = cast
    ti.InterpreterBuilder.create_fmul = fmul


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()


def _dot_by_rows(create_dot):
    """A `create_dot` that multiplies each row of `a` on its own: a row's result is then a function of that row and
    `b` only, as on the GPU, whatever the rest of the block holds."""
    from triton.runtime import interpreter as ti

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        out = np.empty(d.data.shape, dtype=d.data.dtype)
        for i in range(a.data.shape[-2]):
            part = create_dot(self, ti.TensorHandle(a.data[..., i:i + 1, :], a.dtype.scalar), b,
                              ti.TensorHandle(d.data[..., i:i + 1, :], d.dtype.scalar), input_precision,
                              max_num_imprecise_acc)
            out[..., i:i + 1, :] = part.data
        return ti.TensorHandle(out, d.dtype.scalar)

    return dot


@pytest.fixture
def row_independent_dot(monkeypatch) -> None:
    """Under the interpreter, `tl.dot` row by row (module docstring); on a GPU the real one."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from triton.runtime import interpreter as ti

        monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", _dot_by_rows(ti.InterpreterBuilder.create_dot))


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def tilelang_launcher():
    """A `CubinLauncher` over the TileLang kernels' cubins (tests/kernels/tilelang_cubins.py), or a skip."""
    from tests.kernels.tilelang_cubins import cubin_launcher

    found = cubin_launcher()
    if found is None:
        pytest.skip("no TileLang cubins: build them with `python -m tests.kernels.tilelang_cubins` (no GPU needed)")
    return found
