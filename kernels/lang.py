"""Triton, or a stand-in when it is not installed.

A saved artifact runs with torch and the CUDA driver alone: its kernels are prebuilt cubins, and the wrappers
only need each kernel's name to find them. Without Triton, `triton.jit` returns a `NamedKernel` that carries the
Python function (never executed) and its name, and `tl` and `libdevice` (CUDA's math functions) are None;
`from __future__ import annotations` in the kernel modules keeps `tl.constexpr` annotations as strings, so they are
never evaluated.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class NamedKernel:
    """A kernel known by name only (no Triton here): launching it needs a prebuilt cubin."""

    def __init__(self, fn: Callable, **options: Any) -> None:
        self.fn = fn
        self.__name__ = fn.__name__
        self.arg_names = list(inspect.signature(fn).parameters)
        self.options = options

    def __getitem__(self, grid: Any) -> Callable:
        raise RuntimeError(f"kernel {self.__name__} has no prebuilt cubin and Triton is not installed")


class _TritonStandIn:
    @staticmethod
    def jit(fn: Callable | None = None, **options: Any) -> Any:
        if fn is None:
            return lambda f: NamedKernel(f, **options)
        return NamedKernel(fn)

    @staticmethod
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n: int) -> int:
        return 1 << max(0, int(n) - 1).bit_length()


try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    HAS_TRITON = True
except ImportError:  # the artifact runtime
    triton = _TritonStandIn()
    tl = libdevice = None
    HAS_TRITON = False

if HAS_TRITON:
    from triton import knobs
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _PDL = tl.constexpr(not knobs.runtime.interpret)  # the interpreter runs no PTX

    @triton.jit
    def pdl_prologue():
        """Every kernel's first statement: wait until the kernels before it on the stream have finished and their
        writes are visible (`griddepcontrol.wait`), then let the next kernel launch (`launch_dependents`).

        Launched with programmatic stream serialization (graphs/launcher.py), a kernel's blocks may then be placed on
        the GPU while the one before it still runs its last wave, and they wait here instead of at the launch: the
        launch's latency overlaps the previous kernel's tail. Launched without it, both instructions return at once.
        Nothing is read or written before the wait, so a kernel's inputs and the buffers it overwrites are ordered
        exactly as they are without the attribute; the trigger comes after the wait, so at most one kernel waits
        ahead of the one running."""
        if _PDL:
            gdc_wait()
            gdc_launch_dependents()
else:

    @triton.jit
    def pdl_prologue():
        """Without Triton the kernels run as prebuilt cubins: this name keeps their modules importable."""


__all__ = ["triton", "tl", "libdevice", "HAS_TRITON", "NamedKernel", "pdl_prologue"]
