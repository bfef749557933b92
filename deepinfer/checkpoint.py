"""Loading and saving DeepSeek-V4.1 safetensors checkpoints, checked against the tensors the config implies.

A checkpoint is a directory holding `model.safetensors`, or `model.safetensors.index.json` and its shards, or a
single `.safetensors` file. Files are opened with safetensors (memory-mapped, never pickled) after their headers
have been checked against their sizes, so a truncated download fails with the file's name.

Names come back canonical (see `canonical_name`): no `model.` prefix, `head.weight` for `lm_head.weight`, and the
scale of a quantized `<module>.weight` always under `<module>.scale`. Quantized weights stay quantized: fp8 as
float8_e4m3fn, fp4 as packed uint8 codes (see `dsl.quant`), each with its scale as stored (fp32 or
float8_e8m0fnu); `dsl.quant.dequantize(weight, scale)` gives their values. Everything else is returned as stored.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from deepinfer.config import DeepseekV41Config
from deepinfer.models.weights import ExpertShard, WeightSpec, expected_weights

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCALE_DTYPES = FLOAT_DTYPES + (torch.float8_e8m0fnu,)
PACKED_FP4_DTYPES = (torch.uint8, torch.int8, torch.float4_e2m1fn_x2)
_IGNORED = re.compile(r"^(vision\.|aligner\.|image_)|^mtp\.\d+\.(embed|head)\.weight$")  # other models; tied copies
_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
               "BOOL": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4}
_MAX_LISTED = 10


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; the message names the problem."""


def canonical_name(name: str) -> str | None:
    """The canonical form of a stored tensor name, or None for tensors the text model ignores."""
    name = name.removeprefix("model.")
    if name == "lm_head.weight":
        return "head.weight"
    if _IGNORED.search(name):
        return None
    for suffix in (".weight_scale_inv", ".weight.scale"):
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".scale"
    return name


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


# --- files ----------------------------------------------------------------------------------------------------


def read_header(file: str) -> dict[str, dict]:
    """The tensor entries of a safetensors header, after checking that the header and data fit in the file."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"truncated file {file}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n > size - 8:
            raise CheckpointError(f"corrupt header or truncated file {file}: the header claims {n} bytes but the file "
                                  f"has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"corrupt header in {file}: not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt header in {file}: not a JSON object")
    header.pop("__metadata__", None)
    data_end = 0
    for name, entry in header.items():
        try:
            start, end = entry["data_offsets"]
            numel = math.prod(entry["shape"])
            bits = _DTYPE_BITS.get(entry["dtype"])
            ok = 0 <= start <= end and (bits is None or (end - start) * 8 == numel * bits)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"corrupt header in {file}: bad entry for tensor {name!r}: {entry!r}")
        data_end = max(data_end, end)
    if 8 + n + data_end > size:
        raise CheckpointError(f"truncated file {file}: its header places data up to byte {8 + n + data_end}, but the "
                              f"file has {size} bytes")
    return header


def _weight_map(path: str) -> dict[str, str]:
    """Stored tensor name -> file, for a directory, an index file or a single safetensors file."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX_FILE)):
            return _weight_map(os.path.join(path, INDEX_FILE))
        if os.path.exists(os.path.join(path, SINGLE_FILE)):
            return _weight_map(os.path.join(path, SINGLE_FILE))
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.endswith(".json"):
        return {name: path for name in read_header(path)}
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"corrupt index {path}: expected JSON with a `weight_map` of tensor name -> file")
    root = os.path.dirname(path)
    files = {shard: os.path.join(root, shard) for shard in set(weight_map.values())}
    outside = sorted(s for s in files if os.path.isabs(s) or ".." in s.replace("\\", "/").split("/"))
    if outside:
        raise CheckpointError(f"index {path} names shards outside its directory: {_listing(outside)}")
    missing = sorted(s for s, file in files.items() if not os.path.isfile(file))
    if missing:
        raise CheckpointError(f"missing shard(s) named in index {path}: {_listing(missing)}")
    names_in: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names_in.setdefault(shard, []).append(name)
    for shard, file in sorted(files.items()):
        stored = read_header(file)
        lacking = sorted(name for name in names_in[shard] if name not in stored)
        if lacking:
            raise CheckpointError(f"index {path} places tensors in {shard}, which lacks them: {_listing(lacking)}")
    return {name: files[shard] for name, shard in weight_map.items()}


def _read_tensors(weight_map: dict[str, str], progress: bool = False) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor, read with safetensors (under a progress bar over the tensors when `progress`)."""
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    out: dict[str, torch.Tensor] = {}
    stored_as: dict[str, str] = {}
    bar = tqdm(total=len(weight_map), desc="Loading weights", unit="tensor", disable=not progress)
    for file, names in by_file.items():  # headers were checked by `_weight_map`
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in names:
                    bar.update(1)
                    canonical = canonical_name(name)
                    if canonical is None:
                        continue
                    if canonical in out:
                        raise CheckpointError(f"tensor {canonical} is stored twice: as {stored_as[canonical]!r} and "
                                              f"{name!r}")
                    out[canonical], stored_as[canonical] = f.get_tensor(name), name
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for malformed files
            raise CheckpointError(f"cannot read {file}: {type(e).__name__}: {e}") from None
    bar.close()
    return out


# --- validation -----------------------------------------------------------------------------------------------


def _module_scale(name: str) -> str:
    return name.removesuffix(".weight") + ".scale"


def _check_one(name: str, t: torch.Tensor, spec: WeightSpec, specs: dict[str, WeightSpec],
               tensors: dict[str, torch.Tensor], problems: dict[str, list[str]]) -> str | None:
    """Check one tensor against its spec; returns the name of the scale it uses, if quantized."""
    allowed = SCALE_DTYPES if name.endswith(".scale") else FLOAT_DTYPES
    if t.dtype in allowed:
        if tuple(t.shape) != spec.shape:
            problems["misshapen"].append(f"{name}: expected {list(spec.shape)}, got {list(t.shape)}")
        return None
    quantized = (spec.quant == "fp8" and t.dtype == torch.float8_e4m3fn) or (
        spec.quant == "fp4" and t.dtype in PACKED_FP4_DTYPES)
    if not quantized:
        want = "/".join(str(d).removeprefix("torch.") for d in allowed)
        if spec.quant:
            want += " or " + ("float8_e4m3fn" if spec.quant == "fp8" else "packed fp4 (uint8)")
        problems["dtype"].append(f"{name}: expected {want}, got {str(t.dtype).removeprefix('torch.')}")
        return None
    if tuple(t.shape) != spec.quantized_shape():
        problems["misshapen"].append(f"{name} ({spec.quant}): expected {list(spec.quantized_shape())}, "
                                     f"got {list(t.shape)}")
    scale_name = _module_scale(name)
    scale = tensors.get(scale_name)
    if scale is None:
        problems["dtype"].append(f"{name}: stored as {spec.quant} but its scale {scale_name} is missing")
    elif scale_name not in specs:  # a scale that is a model tensor of its own is checked by its own spec
        if scale.dtype not in SCALE_DTYPES:
            problems["dtype"].append(f"{scale_name}: expected float32 or float8_e8m0fnu, got {scale.dtype}")
        elif tuple(scale.shape) != spec.scale_shape():
            problems["misshapen"].append(f"{scale_name} (scale of {name}): expected {list(spec.scale_shape())}, "
                                         f"got {list(scale.shape)}")
    return scale_name


def check_weights(tensors: dict[str, torch.Tensor], specs: dict[str, WeightSpec], where: str = "checkpoint") -> None:
    """Raise `CheckpointError` listing every missing, unexpected, misshapen or wrongly typed tensor."""
    problems: dict[str, list[str]] = {"missing": [], "unexpected": [], "misshapen": [], "dtype": []}
    used_scales: set[str] = set()
    for name, spec in specs.items():
        t = tensors.get(name)
        if t is None:
            if not spec.optional:
                problems["missing"].append(name)
            continue
        scale_name = _check_one(name, t, spec, specs, tensors, problems)
        if scale_name is not None:
            used_scales.add(scale_name)
    problems["unexpected"] = [n for n in tensors if n not in specs and n not in used_scales]
    titles = {"missing": "missing tensors", "unexpected": "unexpected tensors", "misshapen": "misshapen tensors",
              "dtype": "wrong dtype"}
    parts = [f"{titles[k]} ({len(v)}): {_listing(v)}" for k, v in problems.items() if v]
    if parts:
        raise CheckpointError(f"{where} does not match the config: " + "; ".join(parts))


def _num_not_finite(t: torch.Tensor, chunk: int = 1 << 24) -> int:
    """How many values of a stored tensor are NaN or inf, counted a chunk at a time (the checkpoint is memory-mapped:
    no second copy of a large tensor is made). fp8 e4m3 and e8m0 have a NaN code and no inf; packed fp4 has
    neither, nor have integer tensors."""
    if t.dtype == torch.float8_e4m3fn:
        def bad(x: torch.Tensor) -> torch.Tensor:
            return (x.view(torch.uint8) & 0x7F) == 0x7F
    elif t.dtype == torch.float8_e8m0fnu:
        def bad(x: torch.Tensor) -> torch.Tensor:
            return x.view(torch.uint8) == 0xFF
    elif t.is_floating_point():
        def bad(x: torch.Tensor) -> torch.Tensor:
            return ~torch.isfinite(x)
    else:
        return 0
    flat = t.reshape(-1)
    return sum(int(bad(flat[i:i + chunk]).sum()) for i in range(0, flat.numel(), chunk))


def check_finite(tensors: dict[str, torch.Tensor], where: str = "checkpoint") -> None:
    """Raise `CheckpointError` naming every tensor holding NaN or inf (they would make every logit NaN)."""
    bad = [f"{name} ({n} of {t.numel()} values)" for name, t in tensors.items() if (n := _num_not_finite(t))]
    if bad:
        raise CheckpointError(f"{where} has NaN or inf values in {len(bad)} tensor(s): {_listing(bad)}")


# --- public API -----------------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike, config: DeepseekV41Config | None = None,
                    shard: ExpertShard | None = None, progress: bool = False) -> dict[str, torch.Tensor]:
    """Read every tensor of a V4.1 checkpoint under its canonical name, check it against `config` and check that
    every value is finite.

    `path` is a model directory, an index file or a single `.safetensors` file; `config` defaults to the
    directory's `config.json`. With `shard` only that rank's routed experts are read (and expected), besides every
    other tensor; `progress` shows a bar over the tensors read. Raises `CheckpointError` naming the file or tensors
    at fault.
    """
    path = os.fspath(path)
    if config is None:
        config = DeepseekV41Config.from_pretrained(path if os.path.isdir(path) else os.path.dirname(path))
    weight_map = _weight_map(path)
    specs = expected_weights(config)
    if shard is not None:
        weight_map = {n: f for n, f in weight_map.items() if shard.holds(canonical_name(n) or n, config)}
        specs = {n: spec for n, spec in specs.items() if shard.holds(n, config)}
    tensors = _read_tensors(weight_map, progress)
    check_weights(tensors, specs, where=f"checkpoint {path}")
    check_finite(tensors, where=f"checkpoint {path}")
    for name, t in tensors.items():
        if t.dtype in (torch.int8, torch.float4_e2m1fn_x2) and name in specs:
            tensors[name] = t.view(torch.uint8)  # one dtype for packed fp4 codes, whatever the writer used
    return tensors


def save_checkpoint(tensors: dict[str, torch.Tensor], directory: str | os.PathLike,
                    max_shard_bytes: int | None = None) -> None:
    """Write `tensors` as `model.safetensors`, or, past `max_shard_bytes`, as shards with an index.

    Shards are filled greedily in the dict's order (a tensor larger than the limit gets a shard of its own) and
    named `model-00001-of-0000N.safetensors`. Tensors that share storage are written as separate copies.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen and t.numel() else t
        seen.add(ptr)
    total = sum(t.numel() * t.element_size() for t in out.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(out, os.path.join(directory, SINGLE_FILE), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in out.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(directory, file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
