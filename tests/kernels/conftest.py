"""Kernel tests: on CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set in tests/conftest.py).

Triton 3.6's interpreter multiplies bfloat16 operands of `tl.dot` as their raw uint16 bits, casts fp32 to bf16 by
truncation and widens subnormal bf16 wrongly (to zero, or to another value); the GPU does none of these. They are
patched here, for the tests only, so interpreted kernels compute what compiled ones do: bf16 dot operands and casts
widened exactly to fp32, fp32 -> bf16 rounded to nearest even.
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

    ti.InterpreterBuilder.create_dot = dot
    ti.InterpreterBuilder.cast_impl = cast


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter()


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
