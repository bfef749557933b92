"""Launching prebuilt cubins through the CUDA driver (ctypes on libcuda): no Triton, no compiler at run time.

`CubinLauncher` is a `kernels.launch` launcher: a wrapper's `Launch` is matched by its key (kernel, argument
types, constexprs, warps, stages) to a cubin built ahead of time, whose function is loaded once with
cuModuleLoadData and launched with cuLaunchKernel on torch's current stream. A Triton kernel takes the launch's
arguments then its two scratch pointers; a TileLang kernel (spec "backend": "tilelang") takes the arguments its spec's
`arg_order` picks, in that order, with the spec's threads and dynamic shared memory.

A kernel whose cubin begins with the launch-ordering prologue (`kernels.lang.pdl_prologue`; its spec's "pdl") is
launched with cuLaunchKernelEx and programmatic stream serialization: its blocks may start while the kernel before it
finishes, and wait in the prologue. Stream capture keeps the attribute as a programmatic edge of the CUDA graph.
`DEEPINFER_PDL=0` launches every kernel in plain stream order; the results are the same bits either way.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from kernels.launch import Launch

_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def pdl_enabled() -> bool:
    """Whether kernels with the prologue are launched with programmatic stream serialization (`DEEPINFER_PDL`)."""
    return os.environ.get("DEEPINFER_PDL", "1") != "0"


class CudaDriver:
    """The few driver calls a launcher needs, each checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        self.lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig)] + [ctypes.c_void_p] * 3
        self.serialization = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self.check(self.lib.cuInit(0), "cuInit")

    def check(self, code: int, what: str) -> None:
        if code != 0:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(code, ctypes.byref(msg))
            raise RuntimeError(f"{what} failed: CUDA error {code} ({(msg.value or b'?').decode()})")

    def ensure_context(self, device: int) -> None:
        """Make the device's primary context (the one torch uses) current on this thread."""
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        if not ctx.value:
            dev = ctypes.c_int()
            self.check(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
            self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def load_function(self, cubin: bytes, name: str, shared: int) -> ctypes.c_void_p:
        module, fn = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), f"cuModuleLoadData({name})")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()),
                   f"cuModuleGetFunction({name})")
        if shared > 48 * 1024:
            self.check(self.lib.cuFuncSetAttribute(fn, _MAX_DYNAMIC_SHARED, shared), f"cuFuncSetAttribute({name})")
        return fn

    def launch(self, fn: ctypes.c_void_p, grid: tuple[int, int, int], threads: int, shared: int, stream: int,
               params: list[Any], programmatic: bool = False) -> None:
        """Launch `fn` on `stream`; `programmatic`: with programmatic stream serialization (the kernel must begin
        with `pdl_prologue`)."""
        ptrs = (ctypes.c_void_p * len(params))(*[ctypes.addressof(p) for p in params])
        if not programmatic:
            self.check(self.lib.cuLaunchKernel(fn, *grid, threads, 1, 1, shared, ctypes.c_void_p(stream), ptrs, None),
                       "cuLaunchKernel")
            return
        config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(threads, 1, 1), shared, stream,
                               ctypes.pointer(self.serialization), 1)
        self.check(self.lib.cuLaunchKernelEx(ctypes.byref(config), fn, ptrs, None), "cuLaunchKernelEx")


class CubinLauncher:
    """Launches `Launch`es on prebuilt cubins: `cubins[key]` and `specs[key]` from an artifact."""

    def __init__(self, specs: dict[str, dict], cubins: dict[str, bytes], device: int | None = None) -> None:
        self.specs, self.cubins = specs, cubins
        self.device = torch.cuda.current_device() if device is None else device
        self.driver = CudaDriver()
        self.functions: dict[str, ctypes.c_void_p] = {}
        self.launches = 0
        self.programmatic = 0  # of them, launched with programmatic stream serialization
        self.pdl = pdl_enabled()

    def function(self, key: str) -> ctypes.c_void_p:
        if key not in self.functions:
            spec = self.specs[key]
            self.driver.ensure_context(self.device)
            self.functions[key] = self.driver.load_function(self.cubins[key], spec["name"], spec["shared"])
        return self.functions[key]

    def __call__(self, call: Launch) -> None:
        key = call.key()
        spec = self.specs.get(key)
        if spec is None:
            raise KeyError(f"no prebuilt kernel for {key}: the artifact was built for other shapes or configs")
        params = []
        order = spec.get("arg_order")
        args = call.args if order is None else [call.args[i] for i in order]
        for a, t in zip(args, spec["signature"], strict=True):
            if t.startswith("*"):
                if not a.is_cuda or a.data_ptr() % 16:
                    raise ValueError(f"{call.name}: tensor arguments must be 16-byte aligned CUDA tensors")
                params.append(ctypes.c_void_p(a.data_ptr()))
            else:
                params.append(ctypes.c_int32(a))
        grid = tuple(call.grid) + (1,) * (3 - len(call.grid))
        keep = []  # scratch buffers live until the launch is enqueued; the caching allocator orders reuse
        for size_key in ("global_scratch_size", "profile_scratch_size") if spec.get("backend") != "tilelang" else ():
            size = spec[size_key]
            if size:
                buf = torch.empty(size * grid[0] * grid[1] * grid[2], dtype=torch.uint8, device=f"cuda:{self.device}")
                keep.append(buf)
                params.append(ctypes.c_void_p(buf.data_ptr()))
            else:
                params.append(ctypes.c_void_p(0))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        threads = spec.get("threads", 32 * spec["num_warps"])
        programmatic = self.pdl and spec.get("pdl", False)
        self.driver.launch(self.function(key), grid, threads, spec["shared"], stream, params, programmatic)
        self.launches += 1
        self.programmatic += programmatic


__all__ = ["CudaDriver", "CubinLauncher", "pdl_enabled"]
