"""The cpu target's C loops (dsl/native.c), compiled once per machine with the system's C compiler, run by ctypes.

A loop of many tiny steps (Sinkhorn's, 20 iterations over a 4 x 4 matrix per token, 16 times a decode step of
v41-tiny; the fp8 and fp4 roundings and cache codes, the caches' row reads and writes, rope's rotation and the sums
written as elementwise adds, each several torch calls on a row or two)
costs microseconds per torch or numpy call; in C the whole loop takes about as long as one such call. The C code
gives the same bits as the torch code it stands for (tests/test_hyper_sinkhorn.py, tests/test_native_rounding.py,
tests/test_native_rope.py), so the cpu target still matches the reference exactly, with or without it.

The shared library is built on first use into $DEEPINFER_CACHE/native (default ~/.cache/deepinfer/native), named by
a hash of the source, the flags and the compiler's version, written under a temporary name and renamed (concurrent
processes do not see half a file). `$CC` picks the compiler (default `cc`). Where none runs, or
`DEEPINFER_NATIVE=0`, `library()` is None and the callers keep their numpy and torch loops; `reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O2", "-fPIC", "-shared", "-ffp-contract=off", "-fno-fast-math", "-std=c99")
MAX_HC = 4  # DEEPINFER_MAX_HC in native.c: up to 4 values torch adds in order (V4.1's hc is 4)

_why_not: list[str] = []


def cache_root() -> Path:
    """Where built code is kept: $DEEPINFER_CACHE, default ~/.cache/deepinfer (this library under native/, the GPU
    targets' cubins under cubins/: graphs/aot.py)."""
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))


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
    target = cache_root() / "native" / f"native-{key}.so"
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
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    for name, args, result in (("deepinfer_fp8_round_f32", [p, p, i64, i64, f32, f32], None),
                               ("deepinfer_fp4_round_f32", [p, p, i64, i64, i32, f32, f32], None),
                               ("deepinfer_fp8_encode_f32", [p, p, p, i64, i64], None),
                               ("deepinfer_fp4_encode_f32", [p, p, p, i64, i64, i32], i32),
                               ("deepinfer_decode_f32", [p, p, p, i64, i64, i32, i32], None),
                               ("deepinfer_rope_f32", [p, p, p, i64, i64, i64, i64], None),
                               ("deepinfer_load_rows_f32", [p, p, i64, i64, p, p, i64, p, i64, i64, p, i64, i64, i32,
                                                            i32], i32),
                               ("deepinfer_store_rows", [p, p, i64, p, p, i64, i64, i64, p, p, i64, p, i64, i64], i32),
                               ("deepinfer_add_slices_f32", [p, i64, i64, i64, i64, i64, p, i64, p], None),
                               ("deepinfer_weighted_heads_f32", [p, p, p, i64, i64, i64], None)):
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    return lib


def reason() -> str | None:
    """Why `library()` is None (None when it loaded, or before the first call)."""
    return _why_not[-1] if _why_not else None


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> bool:
    """Sinkhorn's loop in place on a contiguous float32 CPU tensor [N, hc, hc]; False, doing nothing, where it cannot
    run (another device or dtype, a view, hc past MAX_HC, no library)."""
    lib = library()
    if (lib is None or comb.device.type != "cpu" or comb.dtype != torch.float32 or not comb.is_contiguous()
            or comb.dim() != 3 or not 1 <= comb.shape[1] <= MAX_HC):
        return False
    return lib.deepinfer_sinkhorn_f32(comb.data_ptr(), comb.shape[0], comb.shape[1], iters, eps) == 0


# ---- fp8 / fp4 rounding and cache codes (dsl/ops/rounding.py, dsl/cache_format.py) --------------------------------
# Each returns None where the C code does not apply (no library; not a contiguous float32 CPU tensor; a last dim that
# is not whole blocks), and the caller runs its torch code. The floors and factors are those torch code's Python
# numbers, which torch rounds to float32 before it multiplies, as ctypes' c_float does here.


def _blocks_of(x: torch.Tensor, block: int, lib) -> int | None:
    """How many blocks of `block` values x holds, or None where the C code does not apply to it."""
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous() or x.dim() == 0
            or block < 1 or x.shape[-1] % block):
        return None
    return x.numel() // block


def fp8_round(x: torch.Tensor, block: int, floor: float, inv_max: float) -> torch.Tensor | None:
    lib = library()
    if (n := _blocks_of(x, block, lib)) is None:
        return None
    out = torch.empty_like(x)
    lib.deepinfer_fp8_round_f32(x.data_ptr(), out.data_ptr(), n, block, floor, inv_max)
    return out


def fp4_round(x: torch.Tensor, block: int, e4m3_scale: bool, floor: float, inv_max: float) -> torch.Tensor | None:
    lib = library()
    if (n := _blocks_of(x, block, lib)) is None:
        return None
    out = torch.empty_like(x)
    lib.deepinfer_fp4_round_f32(x.data_ptr(), out.data_ptr(), n, block, int(e4m3_scale), floor, inv_max)
    return out


def encode(x: torch.Tensor, kind: str, block: int, e4m3_scale: bool) -> list[torch.Tensor] | None:
    """Codes (fp8: float8_e4m3fn [..., D]; fp4: uint8 [..., D / 2]) and scales [..., D / block] (e4m3, or ue8m0 as
    uint8) of float32 values on the format's grid. Raises ValueError naming the first block an e4m3-scaled fp4 entry
    cannot hold."""
    lib = library()
    if (n := _blocks_of(x, block, lib)) is None or (kind == "fp4" and block % 2):
        return None
    lead = tuple(x.shape[:-1])
    scales = torch.empty(*lead, x.shape[-1] // block, dtype=torch.float8_e4m3fn if e4m3_scale else torch.uint8)
    if kind == "fp8":
        codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
        lib.deepinfer_fp8_encode_f32(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), n, block)
        return [codes, scales]
    codes = torch.empty(*lead, x.shape[-1] // 2, dtype=torch.uint8)
    status = lib.deepinfer_fp4_encode_f32(x.data_ptr(), codes.data_ptr(), scales.data_ptr(), n, block, int(e4m3_scale))
    if status:
        raise ValueError(f"a cache entry is not on the fp4 grid with an e4m3 scale (block {-1 - status} of {n}, "
                         f"values {x.reshape(-1, block)[-1 - status].tolist()}): round it with fp4_round first")
    return [codes, scales]


def decode(codes: torch.Tensor, scales: torch.Tensor, kind: str, block: int, e4m3_scale: bool) -> torch.Tensor | None:
    """float32 values [..., D] of codes and scales as `encode` makes them."""
    lib = library()
    if (lib is None or codes.device.type != "cpu" or not codes.is_contiguous() or not scales.is_contiguous()
            or codes.element_size() != 1 or scales.element_size() != 1 or block < 1 or (kind == "fp4" and block % 2)):
        return None
    dim = codes.shape[-1] * (2 if kind == "fp4" else 1)
    if dim % block or scales.shape[-1] * block != dim or math.prod(scales.shape[:-1]) != math.prod(codes.shape[:-1]):
        return None
    out = torch.empty(*codes.shape[:-1], dim, dtype=torch.float32)
    lib.deepinfer_decode_f32(codes.data_ptr(), scales.data_ptr(), out.data_ptr(), out.numel() // block, block,
                             int(kind == "fp4"), int(e4m3_scale))
    return out


def rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor | None:
    """dsl/ops/rope.py's `_rotated` of float32 x [T, ..., D] by rotation [T, (1, ...,) rope_dim / 2, 2, 2] (None where
    the C code does not apply: no library, not contiguous float32 CPU tensors of those shapes)."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or rotation.dtype != torch.float32
            or rotation.device.type != "cpu" or not x.is_contiguous() or not rotation.is_contiguous()
            or x.dim() < 2 or rotation.dim() < 4 or rotation.shape[-2:] != (2, 2)):
        return None
    tokens, dim, half = x.shape[0], x.shape[-1], rotation.shape[-3]
    if rotation.shape[0] != tokens or rotation.numel() != tokens * half * 4 or 2 * half > dim:
        return None
    out = torch.empty_like(x)
    inner = x.numel() // (tokens * dim) if tokens * dim else 0
    lib.deepinfer_rope_f32(x.data_ptr(), rotation.data_ptr(), out.data_ptr(), tokens, inner, dim, half)
    return out


# ---- cache rows (dsl/cache.py's load_rows and store_rows) ----------------------------------------------------------
# A pool part is [count, per, bytes] (blocks or ring slots of `per` rows); pair m of int64 (major, minor) names row
# minor % per of block tables[major, minor // per] (major without `tables`). None / False where the C code does not
# apply (no library; not contiguous CPU tensors of those dtypes; a pair outside the pool, which the torch code
# reports): the caller runs its torch code.


def _pairs(major: torch.Tensor, minor: torch.Tensor, tables: torch.Tensor | None) -> tuple[int, int, int] | None:
    """(tables' pointer or 0, its rows, its width) where the pairs and table are contiguous int64 CPU tensors."""
    for t in (major, minor) if tables is None else (major, minor, tables):
        if t.device.type != "cpu" or t.dtype != torch.int64 or not t.is_contiguous():
            return None
    if major.dim() != 1 or minor.shape != major.shape:
        return None
    if tables is None:
        return 0, 0, 0
    return (tables.data_ptr(), tables.shape[0], tables.shape[1]) if tables.dim() == 2 else None


def _byte_parts(parts: list[torch.Tensor]) -> bool:
    return (len(parts) == 2 and all(p.device.type == "cpu" and p.element_size() == 1 and p.is_contiguous()
                                    and p.dim() == 3 for p in parts) and parts[0].shape[:2] == parts[1].shape[:2])


def load_rows(parts: list[torch.Tensor], major: torch.Tensor, minor: torch.Tensor, tables: torch.Tensor | None,
              kind: str, block: int, e4m3_scale: bool) -> torch.Tensor | None:
    """float32 entries [M, D] stored as fp8 / fp4 codes and scales (`parts`) at the pairs, decoded as `decode` does."""
    lib = library()
    if lib is None or kind not in ("fp8", "fp4") or not _byte_parts(parts) or major.shape[0] == 0:
        return None
    if (table := _pairs(major, minor, tables)) is None:
        return None
    codes, scales = parts
    dim = codes.shape[2] * (2 if kind == "fp4" else 1)
    if block < 1 or dim % block or scales.shape[2] * block != dim:
        return None
    out = torch.empty(major.shape[0], dim, dtype=torch.float32)
    if lib.deepinfer_load_rows_f32(codes.data_ptr(), scales.data_ptr(), codes.shape[0], codes.shape[1],
                                   major.data_ptr(), minor.data_ptr(), major.shape[0], *table, out.data_ptr(), dim,
                                   block, int(kind == "fp4"), int(e4m3_scale)):
        return None
    return out


def store_rows(parts: list[torch.Tensor], encoded: list[torch.Tensor], major: torch.Tensor, minor: torch.Tensor,
               tables: torch.Tensor | None) -> bool:
    """Store encoded rows (codes and scales [M, ...], as `encode` makes them) in `parts` at the pairs, as
    `part[block, row] = encoded` does; False, storing nothing, where the C code does not apply."""
    lib = library()
    if lib is None or not _byte_parts(parts) or len(encoded) != 2 or (table := _pairs(major, minor, tables)) is None:
        return False
    n = major.shape[0]
    for part, rows in zip(parts, encoded, strict=True):
        if (rows.device.type != "cpu" or rows.dtype != part.dtype or not rows.is_contiguous()
                or tuple(rows.shape) != (n, part.shape[2])):
            return False
    return lib.deepinfer_store_rows(encoded[0].data_ptr(), parts[0].data_ptr(), parts[0].shape[2],
                                    encoded[1].data_ptr(), parts[1].data_ptr(), parts[1].shape[2], parts[0].shape[0],
                                    parts[0].shape[1], major.data_ptr(), minor.data_ptr(), n, *table) == 0


# ---- sums of elementwise ops, added in torch's order (the MoE's expert outputs, the indexer's heads) ---------------


def add_slices(x: torch.Tensor, which: list[int]) -> torch.Tensor | None:
    """float32 [n, d]: +0 plus x[which[0]], plus x[which[1]], ... one after the other, as `y += x[j]` adds them in
    torch; x a float32 CPU tensor [k, n, d] of any strides. None where the C code does not apply."""
    lib = library()
    if lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 3:
        return None
    if any(not 0 <= j < x.shape[0] for j in which):
        return None
    _, n, d = x.shape
    y = torch.empty(n, d, dtype=torch.float32)
    index = (ctypes.c_int64 * len(which))(*which)
    lib.deepinfer_add_slices_f32(x.data_ptr(), *x.stride(), n, d, index, len(which), y.data_ptr())
    return y


def weighted_heads(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """float32 [..., width]: s[..., 0, :] * w[..., :1], plus s[..., h, :] * w[..., h:h+1] for each later head h in
    turn, as torch adds them one at a time; s [..., heads, width], w [..., heads] contiguous float32 CPU tensors. None
    where the C code does not apply."""
    lib = library()
    if (lib is None or s.device.type != "cpu" or w.device.type != "cpu" or s.dtype != torch.float32
            or w.dtype != torch.float32 or not s.is_contiguous() or not w.is_contiguous() or s.dim() < 2
            or tuple(w.shape) != tuple(s.shape[:-1]) or s.shape[-2] < 1):
        return None
    out = torch.empty(*s.shape[:-2], s.shape[-1], dtype=torch.float32)
    lib.deepinfer_weighted_heads_f32(s.data_ptr(), w.data_ptr(), out.data_ptr(), w.numel() // w.shape[-1],
                                     s.shape[-2], s.shape[-1])
    return out
