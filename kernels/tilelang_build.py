"""Building a TileLang kernel ahead of time on any machine, no GPU needed: `tilelang.lower` to CUDA source for the
target, nvcc to a cubin (its PTX kept for reading), and what a driver launch needs from the lowered kernel: its name,
its parameters in order, threads per block and dynamic shared memory.

nvcc is $DEEPINFER_NVCC, else the one on PATH, else the pip package nvidia-cuda-nvcc (`pip install tilelang[nvcc]`
puts it at site-packages/nvidia/cu13/bin/nvcc). TileLang ships the CUDA templates its source includes (tl_templates,
CUTLASS). `DEEPINFER_TILELANG=0` turns TileLang kernels off: plans then choose their Triton kernels.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernels.launch import Launch
from kernels.tilelang_kernel import TileLangKernel

DTYPES = {"*fp32": "float32", "*bf16": "bfloat16", "*fp16": "float16", "*u8": "uint8", "*i8": "int8", "*i32": "int32",
          "*i64": "int64", "i32": "int32"}


@dataclass(frozen=True)
class Binary:
    cubin: bytes
    ptx: str
    source: str  # the CUDA C++ TileLang generated
    name: str  # the __global__ function
    params: list[str]  # the launch's argument names (`TileLangKernel.arg_names`) in the function's parameter order
    threads: int
    shared: int  # dynamic shared memory, bytes


def nvcc() -> str | None:
    path = os.environ.get("DEEPINFER_NVCC") or shutil.which("nvcc")
    if path:
        return path
    try:
        files = importlib.metadata.files("nvidia-cuda-nvcc") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if f.name == "nvcc"), None)


def available() -> bool:
    """Whether TileLang kernels can be built here: tilelang installed, an nvcc found, not turned off."""
    if os.environ.get("DEEPINFER_TILELANG", "1") == "0":
        return False
    try:
        found = importlib.util.find_spec("tilelang") is not None
    except ValueError:  # sys.modules["tilelang"] = None: hidden on purpose
        found = False
    return found and nvcc() is not None


@functools.cache
def versions() -> str:
    """The tools a cubin depends on, for cache keys and the artifact's manifest."""
    out = subprocess.run([nvcc(), "--version"], capture_output=True, text=True, check=True).stdout
    release = next(line for line in out.splitlines() if "release" in line)  # "..., release 13.0, V13.0.88"
    return f"tilelang {importlib.metadata.version('tilelang')}, nvcc {release.split()[-1]}"


def lower(call: Launch, arch: str):
    """TileLang's lowering of one launch for `arch` ("sm_90a", "sm_100a"): (CUDA source, the device function)."""
    import tilelang
    from tilelang import tvm

    kernel: TileLangKernel = call.kernel
    dtypes = {name: DTYPES[t] for name, t in zip(kernel.arg_names, call.signature(), strict=True)}
    program = kernel.fn(dtypes, 32 * call.num_warps, **call.constexprs)
    target = tvm.target.Target({"kind": "cuda", "arch": arch})
    with tvm.transform.PassContext(opt_level=3), target:
        lowered = tilelang.lower(program, target=target)
    (function,) = lowered.device_mod.functions.items()
    return lowered.kernel_source, function


def launch_shape(call: Launch, function) -> tuple[list[str], int, int]:
    """(parameter names, threads, dynamic shared memory) of the device function, checked against the launch: its
    block is `32 * num_warps` threads and its grid, evaluated at the launch's ints, is the launch's grid."""
    from tilelang import tvm

    gvar, fn = function
    kernel: TileLangKernel = call.kernel
    names = [p.name for p in fn.params]
    if not set(names) <= set(kernel.arg_names):
        raise ValueError(f"{gvar.name_hint}: parameters {names} are not among the launch's {kernel.arg_names}")
    ints = {name: a for name, a in zip(kernel.arg_names, call.args, strict=True) if isinstance(a, int)}
    for p in fn.params:
        if (str(p.dtype) == "handle") != (p.name not in ints):
            raise ValueError(f"{gvar.name_hint}: parameter {p.name} ({p.dtype}) does not match the launch's argument")
    extent = {k: v for k, v in fn.attrs["thread_extent"].items()}
    threads = [int(extent.get(f"threadIdx.{a}", 1)) for a in "xyz"]
    if threads != [32 * call.num_warps, 1, 1]:
        raise ValueError(f"{gvar.name_hint}: block {threads}, the launch has {32 * call.num_warps} threads")
    values = {p: tvm.tirx.IntImm("int32", ints[p.name]) for p in fn.params if p.name in ints}
    analyzer = tvm.arith.Analyzer()
    grid = [int(analyzer.simplify(tvm.tirx.stmt_functor.substitute(extent[f"blockIdx.{a}"], values)))
            if f"blockIdx.{a}" in extent else 1 for a in "xyz"]
    if grid != list(call.grid) + [1] * (3 - len(call.grid)):
        raise ValueError(f"{gvar.name_hint}: the kernel's grid is {grid} where the wrapper launches {call.grid}")
    return names, threads[0], int(fn.attrs.get("dyn_shared_memory_buf", 0) or 0)


def nvcc_cubin(source: str, arch: str) -> tuple[bytes, str]:
    """(cubin, PTX) of TileLang's CUDA source for `arch`."""
    import tilelang.env

    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("building TileLang kernels needs nvcc: a CUDA toolkit on PATH, $DEEPINFER_NVCC, or "
                           "`pip install tilelang[nvcc]`")
    with tempfile.TemporaryDirectory(prefix="deepinfer-tl-") as tmp:
        src, out = Path(tmp, "kernel.cu"), Path(tmp, "kernel.cubin")
        src.write_text(source)
        cmd = [compiler, "--cubin", "-std=c++20", "-O3", "-w", "-gencode", f"arch=compute_{arch[3:]},code={arch}",
               f"-I{tilelang.env.TILELANG_TEMPLATE_PATH}", f"-I{tilelang.env.CUTLASS_INCLUDE_DIR}", "-keep",
               f"-keep-dir={tmp}", "-o", str(out), str(src)]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=tmp)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch}:\n{done.stdout}{done.stderr}"[-4000:])
        return out.read_bytes(), Path(tmp, "kernel.ptx").read_text()


def compile_launch(call: Launch, arch: str) -> Binary:
    """Lower and compile one recorded launch of a TileLang kernel for `arch` ("sm_90a" | "sm_100a")."""
    source, function = lower(call, arch)
    params, threads, shared = launch_shape(call, function)
    cubin, ptx = nvcc_cubin(source, arch)
    return Binary(cubin, ptx, source, function[0].name_hint, params, threads, shared)


__all__ = ["DTYPES", "Binary", "available", "compile_launch", "nvcc", "versions"]
