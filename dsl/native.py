"""The cpu target's C loops (dsl/native.c), compiled once per machine with the system's C compiler, run by ctypes.

A loop of many tiny steps (Sinkhorn's, 20 iterations over a 4 x 4 matrix per token, 16 times a decode step of
v41-tiny) costs microseconds per torch or numpy call; in C the whole loop takes about as long as one such call.
The C code gives the same bits as the torch code it stands for (tests/test_native.py), so the cpu target still
matches the reference exactly, with or without it.

The shared library is built on first use into $DEEPINFER_CACHE/native (default ~/.cache/deepinfer/native), named by
a hash of the source, the flags and the compiler's version, written under a temporary name and renamed (concurrent
processes do not see half a file). `$CC` picks the compiler (default `cc`). Where none runs, or
`DEEPINFER_NATIVE=0`, `library()` is None and the callers keep their numpy and torch loops; `reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=c99")
MAX_HC = 4  # DEEPINFER_MAX_HC in native.c: up to 4 values torch adds in order (V4.1's hc is 4)

_why_not: list[str] = []


def _cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer")) / "native"


def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise OSError(f"`{cc} --version` exited with {done.returncode}")
    return done.stdout.splitlines()[0] if done.stdout else ""


def _build(cc: str) -> Path:
    """The shared library's path, compiling it if this machine has not yet."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), _compiler_version(cc).encode(),
                                     platform.machine().encode()])).hexdigest()[:16]
    target = _cache_dir() / f"native-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run([cc, *FLAGS, "-o", str(built), str(SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if done.returncode:
            raise OSError(f"`{cc}` could not compile {SOURCE.name}: {done.stderr.strip()[:500]}")
        os.replace(built, target)
    return target


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library with its functions' signatures set, or None (see `reason()`)."""
    if os.environ.get("DEEPINFER_NATIVE", "1") == "0":
        _why_not.append("DEEPINFER_NATIVE=0")
        return None
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        _why_not.append(f"no C compiler: `{cc}` is not on PATH")
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        _why_not.append(str(e))
        return None
    lib.deepinfer_sinkhorn_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                           ctypes.c_float]
    lib.deepinfer_sinkhorn_f32.restype = ctypes.c_int
    return lib


def reason() -> str | None:
    """Why `library()` is None (None when it loaded, or before the first call)."""
    return _why_not[-1] if _why_not else None


def sinkhorn_f32(data_ptr: int, n: int, hc: int, iters: int, eps: float) -> bool:
    """Sinkhorn's loop in place on `n` contiguous float32 matrices [hc, hc] at `data_ptr` (the caller keeps the
    memory alive); False, doing nothing, where the library is missing or hc is past MAX_HC."""
    lib = library()
    if lib is None or hc > MAX_HC or hc < 1:
        return False
    return lib.deepinfer_sinkhorn_f32(data_ptr, n, hc, iters, eps) == 0
