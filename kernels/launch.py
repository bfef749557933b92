"""How a wrapper's kernel call reaches the device: Triton's JIT by default, prebuilt cubins in an artifact.

Every wrapper ends in `launch(kernel, grid, args, constexprs, num_warps, num_stages)`. Runtime arguments
(`args`) are tensors and ints only; everything fixed by the weights or the tuned config is a constexpr, so the
set of compiled variants a plan needs is known ahead of time (one per node shape and token-count bucket) and a
cubin built for it serves every token count in its bucket. `use_launcher` swaps in another launcher: the AOT
builder records launches on meta tensors, the artifact runtime launches cubins through the CUDA driver. TileLang
kernels have no JIT here: the default launcher runs their torch equivalent (kernels/tilelang_kernel.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels.tilelang_kernel import TileLangKernel

_TYPES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
          torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8", torch.int8: "i8", torch.int32: "i32", torch.int64: "i64"}


@dataclass(frozen=True)
class Launch:
    kernel: Any  # a @triton.jit function (or its stand-in), or a TileLangKernel
    grid: tuple[int, ...]
    args: tuple[Any, ...]  # tensors and ints, in the kernel's order
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def signature(self) -> list[str]:
        """Triton type strings of the runtime arguments: `*bf16` for a tensor, `i32` for an int."""
        return [arg_type(a) for a in self.args]

    def key(self) -> str:
        """Names one compiled variant: kernel, runtime argument types, constexprs and launch options."""
        consts = ",".join(f"{k}={v}" for k, v in sorted(self.constexprs.items()))
        return f"{self.name}({','.join(self.signature())})[{consts}]w{self.num_warps}s{self.num_stages}"


def arg_type(a: Any) -> str:
    if isinstance(a, torch.Tensor):
        if a.dtype not in _TYPES:
            raise TypeError(f"no kernel argument type for {a.dtype}")
        return "*" + _TYPES[a.dtype]
    if isinstance(a, bool) or not isinstance(a, int):
        raise TypeError(f"runtime kernel arguments are tensors or ints, got {type(a).__name__}")
    if not -(2**31) <= a < 2**31:
        raise ValueError(f"int argument {a} does not fit i32")
    return "i32"


def jit_launch(call: Launch) -> None:
    if isinstance(call.kernel, TileLangKernel):  # built ahead of time only: here, its torch equivalent
        call.kernel.emulate(*call.args, **call.constexprs)
        return
    call.kernel[call.grid](*call.args, **call.constexprs, num_warps=call.num_warps, num_stages=call.num_stages)


_launcher: Callable[[Launch], None] = jit_launch


def launch(kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], constexprs: dict[str, Any],
           num_warps: int = 4, num_stages: int = 2) -> None:
    """Launch `kernel` on `grid` through the current launcher (an empty grid launches nothing)."""
    if any(g == 0 for g in grid):
        return
    _launcher(Launch(kernel, tuple(grid), tuple(args), dict(constexprs), num_warps, num_stages))


def is_jit() -> bool:
    """Whether launches go to Triton's JIT: no other launcher (an artifact's cubins, a recorder) is in use."""
    return _launcher is jit_launch


@contextlib.contextmanager
def use_launcher(fn: Callable[[Launch], None]) -> Iterator[None]:
    """Route every `launch` inside the block to `fn`."""
    global _launcher
    previous, _launcher = _launcher, fn
    try:
        yield
    finally:
        _launcher = previous


__all__ = ["Launch", "launch", "use_launcher", "is_jit", "jit_launch", "arg_type"]
