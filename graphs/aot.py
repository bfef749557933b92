"""Ahead-of-time builds: every kernel variant a plan needs, compiled to cubins for sm_90a or sm_100a on a machine
with no GPU (`triton.compile` with a `GPUTarget`).

The variants are found by running each kernel node's wrapper on meta tensors of each bucket's token count
with a launcher that records instead of launching; the wrapper's checks and its argument order are therefore
the same ones that run later on the device. Built cubins are cached by content (kernel source, variant, target,
Triton version) under $DEEPINFER_CACHE (default ~/.cache/deepinfer), so a rebuild is instant.
`DEEPINFER_DEBUG=source` prints each variant's Triton GPU IR as it is compiled.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from graphs.lowering import LOWERINGS
from graphs.plan import Plan
from kernels.launch import Launch, use_launcher

ARCHS = {"sm90": 90, "sm100": 100}


@dataclass(frozen=True)
class Built:
    """One compiled variant: its cubin, PTX (for inspection) and launch spec."""

    cubin: bytes
    ptx: str
    spec: dict

    @property
    def file_id(self) -> str:
        return self.spec["id"]


def record_launches(plan: Plan, attrs_of: dict[int, dict]) -> dict[str, Launch]:
    """Every distinct kernel launch (by `Launch.key`) the plan's kernel nodes make, for each bucket and with the
    batch-invariant config (whose launches are the same for every token count)."""
    found: dict[str, Launch] = {}

    def record(call: Launch) -> None:
        found.setdefault(call.key(), call)

    with use_launcher(record):
        for node in plan.kernel_nodes():
            lowering = LOWERINGS[node.op]
            runs = [(node.configs[b], b) for b in plan.buckets]
            if node.invariant is not None:
                runs.append((node.invariant, plan.buckets[0]))
            for config, m in runs:
                lowering.trace(node.static, attrs_of[node.index], config, m, plan.dot_fp32)
    return found


def kernel_source(kernel) -> str:
    fn = getattr(kernel, "fn", kernel)
    return inspect.getsource(fn)


def _variant_id(call: Launch, target: str) -> str:
    import triton

    text = f"{call.key()}|{target}|{triton.__version__}|{kernel_source(call.kernel)}"
    return f"{call.name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def compile_launch(call: Launch, target: str) -> Built:
    """Compile one recorded launch for `target` ("sm90" | "sm100") with Triton, no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = call.kernel.arg_names
    runtime = names[: len(call.args)]
    if set(names[len(call.args):]) != set(call.constexprs):
        raise ValueError(f"{call.name}: runtime args must come first, then exactly the constexprs")
    types = call.signature()
    signature = dict(zip(runtime, types, strict=True)) | {k: "constexpr" for k in call.constexprs}
    # pointers are 16-byte aligned: the launcher checks it on every launch
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(types) if t.startswith("*")}
    src = ASTSource(fn=call.kernel, signature=signature, constexprs=call.constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", ARCHS[target], 32),
                       options={"num_warps": call.num_warps, "num_stages": call.num_stages})
    md = k.metadata
    if "source" in os.environ.get("DEEPINFER_DEBUG", "").split(","):
        print(f"// {call.key()} for {target}\n{k.asm['ttgir']}", file=sys.stderr)
    spec = {"id": _variant_id(call, target), "key": call.key(), "name": md.name, "target": target,
            "arch": f"sm_{ARCHS[target]}a", "signature": types, "constexprs": call.constexprs,
            "num_warps": call.num_warps, "num_stages": call.num_stages, "shared": md.shared,
            "global_scratch_size": md.global_scratch_size, "global_scratch_align": md.global_scratch_align,
            "profile_scratch_size": md.profile_scratch_size, "profile_scratch_align": md.profile_scratch_align,
            "triton": triton.__version__,
            "source_sha256": hashlib.sha256(kernel_source(call.kernel).encode()).hexdigest()}
    return Built(k.asm["cubin"], k.asm["ptx"], spec)


def _cache_dir() -> Path:
    return Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer")) / "cubins"


def build(launches: dict[str, Launch], target: str, use_cache: bool = True) -> dict[str, Built]:
    """Compile every launch for `target`, reusing cached cubins. Returns key -> Built."""
    if target not in ARCHS:
        raise ValueError(f"no cubin build for target {target!r}")
    out = {}
    cache = _cache_dir()
    for key, call in launches.items():
        vid = _variant_id(call, target)
        paths = [cache / f"{vid}.{ext}" for ext in ("cubin", "ptx", "json")]
        if use_cache and all(p.exists() for p in paths):
            out[key] = Built(paths[0].read_bytes(), paths[1].read_text(), json.loads(paths[2].read_text()))
            continue
        built = compile_launch(call, target)
        if use_cache:
            cache.mkdir(parents=True, exist_ok=True)
            paths[0].write_bytes(built.cubin)
            paths[1].write_text(built.ptx)
            paths[2].write_text(json.dumps(built.spec, indent=1))
        out[key] = built
    return out


__all__ = ["Built", "record_launches", "compile_launch", "build", "ARCHS"]
