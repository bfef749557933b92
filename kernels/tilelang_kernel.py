"""A TileLang kernel as `kernels.launch` sees it: a named program with runtime arguments, built ahead of time.

Building one needs TileLang and nvcc (kernels/tilelang_build.py); running one needs neither: an artifact's cubins
run through `graphs.launcher` with torch and the CUDA driver alone. TileLang has no interpreter, so where no prebuilt
cubin is launched (the default launcher, Triton's JIT: CPU tests under Triton's interpreter, GPU runs without an
artifact) a TileLang launch runs the kernel's torch equivalent on the same arguments, writing its outputs in place.
The plan's nodes then compute what their op defines, in torch instead of on the kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


class TileLangKernel:
    """`program(dtypes, threads, **constexprs)` returns the kernel's `T.prim_func` (it imports tilelang): `dtypes`
    maps each runtime argument's name to its TileLang dtype. `arg_names` are the runtime arguments in launch order:
    the program's tensors by name, then its dynamic shape symbols (ints). `emulate(*args, **constexprs)` writes the
    same outputs in torch."""

    def __init__(self, program: Callable[..., Any], emulate: Callable[..., None], arg_names: Sequence[str]) -> None:
        self.fn = program  # what the tuning cache (autotune.source_hash) and the cubin cache hash
        self.emulate = emulate
        self.arg_names = tuple(arg_names)
        self.__name__ = program.__name__

    def __repr__(self) -> str:
        return f"TileLangKernel({self.__name__})"


def row_tiles(config: dict, what: str) -> tuple[int, int]:
    """(block_M, threads) of a row kernel's config: `block_M` rows a block over `threads`, a multiple of 32 and of
    block_M, at most 1024. `what` names the kernel in the error."""
    block_m, threads = config["block_M"], config["threads"]
    if threads % 32 or threads % block_m or not 32 <= threads <= 1024:
        raise ValueError(f"{what} config {config}: threads must be a multiple of 32 and of block_M, at most 1024")
    return block_m, threads


__all__ = ["TileLangKernel", "row_tiles"]
