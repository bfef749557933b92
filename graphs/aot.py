"""Ahead-of-time builds: every kernel variant a plan needs, compiled to cubins for sm_90a or sm_100a on a machine
with no GPU (`triton.compile` with a `GPUTarget`; TileLang kernels through `tilelang.lower` and nvcc,
kernels/tilelang_build.py).

The variants are found by running each kernel node's wrapper on meta tensors of each bucket's token count
with a launcher that records instead of launching; the wrapper's checks and its argument order are therefore
the same ones that run later on the device. Built cubins are cached by content (kernel source, variant, target,
Triton version, or TileLang and nvcc versions) under $DEEPINFER_CACHE (default ~/.cache/deepinfer), so a rebuild is
instant. `DEEPINFER_DEBUG=source` prints each variant's Triton GPU IR (TileLang: CUDA source) as it is compiled.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import os
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kernels.attention.block_attention as block_attention
import kernels.attention.paged_attention as paged_attention
import kernels.attention.paged_ops as paged_ops
import kernels.cache.rows as cache_kernels
import kernels.indexer.index_scores as scores
import kernels.sampling.gumbel_argmax as sampling_kernels
from dsl.cache import CacheSpec
from dsl.graph import Graph
from dsl.native import cache_root
from graphs.executor import EXCHANGED
from graphs.plan import Plan
from kernels.launch import Launch, use_launcher
from kernels.registry import LOWERINGS
from kernels.targets import get_target
from kernels.tilelang_kernel import TileLangKernel


@dataclass(frozen=True)
class Built:
    """One compiled variant: its cubin, PTX (for inspection) and launch spec; a TileLang kernel's CUDA source too."""

    cubin: bytes
    ptx: str
    spec: dict
    source: str = ""
    ttgir: str = ""  # a Triton variant's GPU IR as compiled here (not cached): its layouts, for inspection

    @property
    def file_id(self) -> str:
        return self.spec["id"]


def record_launches(plan: Plan, attrs_of: dict[int, dict], expert_parallel: bool = False) -> dict[str, Launch]:
    """Every distinct kernel launch (by `Launch.key`) the plan's kernel nodes make, for each bucket and with the
    batch-invariant config (whose launches are the same for every token count); with `expert_parallel`, also those
    of the MoE nodes exchanging their pairs with other ranks (`MoeExperts.trace_parallel`)."""
    found: dict[str, Launch] = {}

    def record(call: Launch) -> None:
        found.setdefault(call.key(), call)

    with use_launcher(record):
        for node in plan.kernel_nodes():
            lowering = LOWERINGS[node.op]
            runs = [(node.buckets[b], b, False) for b in plan.buckets] + [(node.invariant, plan.buckets[0], True)]
            for chosen, m, invariant in runs:
                call = node.call(chosen, attrs_of[node.index], plan.dot_fp32, tokens=m)
                lowering.trace(call)
                if expert_parallel and node.op in EXCHANGED:
                    lowering.trace_parallel(call, invariant)
    return found


def record_cache_launches(spec: CacheSpec) -> dict[str, Launch]:
    """The launches of the cache kernels (kernels/cache/rows.py) for the caches of `spec`: the pools' writer and
    reader on a GPU target, one variant per format and dim whatever the number of rows."""
    found: dict[str, Launch] = {}
    with use_launcher(lambda call: found.setdefault(call.key(), call)):
        cache_kernels.trace(spec)
    return found


def record_attention_launches(plan: Plan, graph: Graph, caches: Graph | None = None) -> dict[str, Launch]:
    """The launches of the in-place decode attention (kernels/attention/paged_attention.py) that the plan's causal
    attention nodes over a window append make on decode and verification steps, of the draft block kernel
    (kernels/attention/block_attention.py) for non-causal ones over a `kv_window_block` (DSpark's draft pass), and of
    the indexer's in-place scores (kernels/indexer/index_scores.py) over a cache the graph appends to: for each, the
    formats of its caches (off `caches`, the graph that declares them: `graph` itself, or for a draft graph its
    model's), every bucket's config and the batch-invariant one."""
    spec = CacheSpec.from_graph(caches if caches is not None else graph)
    windows = {layer: fmt for layer, _, _, fmt in spec.windows}
    pools = {(name, layer): fmt for name, layer, _, _, fmt in spec.compressed}
    found: dict[str, Launch] = {}
    with use_launcher(lambda call: found.setdefault(call.key(), call)):
        for node in plan.kernel_nodes():
            op = graph.nodes[node.index]
            keys = op.inputs[2].producer if node.op == "index_scores" else None
            if keys is not None and keys.op == "cache_append" and paged_attention.supports(node.static.d):
                for chosen in [node.buckets[b] for b in plan.buckets] + [node.invariant]:
                    scores.trace_paged(node.static.h, node.static.d, ratio=op.attrs["ratio"],
                                       fmt=pools[(keys.attrs["name"], keys.attrs["layer"])], config=chosen.config,
                                       dot_fp32=plan.dot_fp32)
                continue
            window = op.inputs[1].producer if node.op == "sparse_attention" else None
            if (window is not None and window.op == "kv_window_block" and not op.attrs.get("causal", True)
                    and paged_attention.supports(node.static.d)):
                for chosen in [node.buckets[b] for b in plan.buckets] + [node.invariant]:
                    block_attention.trace_block(node.static.h, node.static.d, window_size=op.attrs["window_size"],
                                                scale=op.attrs["scale"], window_fmt=windows[window.attrs["layer"]],
                                                config=chosen.config, dot_fp32=plan.dot_fp32)
                continue
            if (window is None or window.op != "kv_window_append" or not op.attrs.get("causal", True)
                    or not paged_attention.supports(node.static.d)):  # head dims the kernel does not take gather
                continue
            compressed, topk = (list(op.inputs) + [None, None])[3:5]
            pool_fmt, k = None, 0
            if compressed is not None and topk is not None and compressed.producer is not None:
                source = compressed.producer.attrs
                pool_fmt, k = pools[(source["name"], source["layer"])], int(topk.type.shape[-1])
            for chosen in [node.buckets[b] for b in plan.buckets] + [node.invariant]:
                # the widths a forward's picks run at, and none: a step where no sequence has compressed entries yet
                for picks in [0, *paged_ops.pick_widths(k)] if k else [0]:
                    paged_ops.trace(node.static.h, node.static.d, window_size=op.attrs["window_size"],
                                    scale=op.attrs["scale"], window_fmt=windows[window.attrs["layer"]],
                                    pool_fmt=pool_fmt, topk=picks, config=chosen.config, dot_fp32=plan.dot_fp32)
    return found


def record_sampling_launches(vocab_size: int) -> dict[str, Launch]:
    """The launches of the sampling kernel (kernels/sampling/gumbel_argmax.py) for fp32 logits of `vocab_size` tokens:
    the engine's draws on a GPU target, one variant whatever the number of rows."""
    found: dict[str, Launch] = {}
    with use_launcher(lambda call: found.setdefault(call.key(), call)):
        sampling_kernels.trace(vocab_size)
    return found


_SOURCES: dict[int, tuple[Any, str]] = {}  # id(kernel) -> (kernel, its source): read once a process


def kernel_source(kernel) -> str:
    """A kernel's source and, for a Triton kernel, the sources of the @triton.jit helpers it calls, transitively: an
    edit to a helper (kernels/cache/rows.py's serve the rounding kernels too) must rebuild every kernel using it.
    Read once per kernel object (a compile asks for each kernel's source once per variant: about 1,000 reads of
    inspect.getsource, most of a compile's time when every cubin is in the cache)."""
    held = _SOURCES.get(id(kernel))
    if held is None or held[0] is not kernel:
        held = _SOURCES[id(kernel)] = (kernel, _read_source(kernel))
    return held[1]


def _read_source(kernel) -> str:
    if not _is_jit(kernel):
        return inspect.getsource(getattr(kernel, "fn", kernel))
    found, todo = [], [kernel]
    while todo:
        k = todo.pop(0)
        if any(k is f for f in found):
            continue
        found.append(k)
        names = {n.id for n in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(k.fn)))) if isinstance(n, ast.Name)}
        todo += [h for name in sorted(names) if _is_jit(h := k.fn.__globals__.get(name))]
    return "".join(inspect.getsource(k.fn) for k in found)


def _is_jit(obj) -> bool:
    return callable(getattr(obj, "fn", None)) and hasattr(obj, "arg_names") and not isinstance(obj, TileLangKernel)


def _tools(call: Launch) -> str:
    if isinstance(call.kernel, TileLangKernel):
        from kernels.tilelang_build import versions

        return versions()
    import triton

    return triton.__version__


def _variant_id(call: Launch, target: str) -> str:
    text = f"{call.key()}|{target}|{_tools(call)}|{kernel_source(call.kernel)}"
    return f"{call.name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _debug_source() -> bool:
    return "source" in os.environ.get("DEEPINFER_DEBUG", "").split(",")


def compile_tilelang(call: Launch, target: str) -> Built:
    """Lower one recorded launch of a TileLang kernel for `target` and compile it with nvcc, no GPU needed. Its spec
    names the device function's parameters in launch order (`arg_order`), its threads and dynamic shared memory."""
    from kernels.tilelang_build import compile_launch as build_tilelang

    arch = get_target(target).arch
    b = build_tilelang(call, arch)
    if _debug_source():
        print(f"// {call.key()} for {target}\n{b.source}", file=sys.stderr)
    order = [call.kernel.arg_names.index(name) for name in b.params]
    types = call.signature()
    spec = {"id": _variant_id(call, target), "key": call.key(), "name": b.name, "target": target, "arch": arch,
            "backend": "tilelang", "signature": [types[i] for i in order], "arg_order": order,
            "constexprs": call.constexprs, "num_warps": call.num_warps, "num_stages": call.num_stages,
            "threads": b.threads, "shared": b.shared, "tilelang": _tools(call), "pdl": _waits_for_grid(b.ptx),
            "source_sha256": hashlib.sha256(kernel_source(call.kernel).encode()).hexdigest()}
    return Built(b.cubin, b.ptx, spec, b.source)


def compile_launch(call: Launch, target: str) -> Built:
    """Compile one recorded launch for a cubin target (kernels/targets.py) with Triton (or TileLang), no GPU
    needed."""
    if isinstance(call.kernel, TileLangKernel):
        return compile_tilelang(call, target)
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
    k = triton.compile(src, target=GPUTarget("cuda", get_target(target).triton_arch, 32),
                       options={"num_warps": call.num_warps, "num_stages": call.num_stages})
    md = k.metadata
    if _debug_source():
        print(f"// {call.key()} for {target}\n{k.asm['ttgir']}", file=sys.stderr)
    spec = {"id": _variant_id(call, target), "key": call.key(), "name": md.name, "target": target,
            "arch": get_target(target).arch, "signature": types, "constexprs": call.constexprs,
            "num_warps": call.num_warps, "num_stages": call.num_stages, "shared": md.shared,
            "global_scratch_size": md.global_scratch_size, "global_scratch_align": md.global_scratch_align,
            "profile_scratch_size": md.profile_scratch_size, "profile_scratch_align": md.profile_scratch_align,
            "triton": triton.__version__, "pdl": _waits_for_grid(k.asm["ptx"]),
            "source_sha256": hashlib.sha256(kernel_source(call.kernel).encode()).hexdigest()}
    return Built(k.asm["cubin"], k.asm["ptx"], spec, ttgir=k.asm["ttgir"])


def _waits_for_grid(ptx: str) -> bool:
    """Whether a kernel waits for the grids before it (`kernels.lang.pdl_prologue`) before it touches global memory:
    only such a kernel may be launched with programmatic stream serialization (graphs/launcher.py). The body's
    instructions are read in order up to the first `griddepcontrol.wait`; a load, store, atomic or copy that may reach
    global memory before it (any but those of parameters, shared, local or constant memory), or no wait, says no."""
    entry = ptx.find(".entry")
    body = ptx[ptx.find("{", ptx.find(")", entry)) + 1:] if entry >= 0 else ""
    for line in body.splitlines():
        op = re.match(r"\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)", line)
        if op is None:
            continue
        if op[1] == "griddepcontrol.wait":
            return True
        if op[1].split(".")[0] in _MEMORY_OPS and not any(f".{space}" in op[1] for space in _ON_CHIP):
            return False
    return False


_MEMORY_OPS = {"ld", "ldu", "st", "atom", "red", "cp", "prefetch", "prefetchu", "multimem"}
_ON_CHIP = ("param", "shared", "local", "const")


def _cache_dir() -> Path:
    return cache_root() / "cubins"


def build(launches: dict[str, Launch], target: str, use_cache: bool = True) -> dict[str, Built]:
    """Compile every launch for `target`, reusing cached cubins. Returns key -> Built."""
    if not get_target(target).builds_cubins:
        raise ValueError(f"no cubin build for target {target!r}")
    out = {}
    cache = _cache_dir()
    for key, call in launches.items():
        vid = _variant_id(call, target)
        paths = [cache / f"{vid}.{ext}" for ext in ("cubin", "ptx", "json", "cu")]
        if use_cache and paths[0].exists() and paths[2].exists():  # the PTX is optional: a copy of the cache made
            # to travel (bench/prepare_gpu.py) leaves it out, and nothing but a saved artifact's reader uses it
            ptx, source = (q.read_text() if q.exists() else "" for q in (paths[1], paths[3]))
            out[key] = Built(paths[0].read_bytes(), ptx, json.loads(paths[2].read_text()), source)
            continue
        built = compile_launch(call, target)
        if use_cache:
            cache.mkdir(parents=True, exist_ok=True)
            if built.source:
                paths[3].write_text(built.source)
            paths[0].write_bytes(built.cubin)
            paths[1].write_text(built.ptx)
            paths[2].write_text(json.dumps(built.spec, indent=1))
        out[key] = built
    return out


__all__ = ["Built", "record_launches", "record_cache_launches", "record_attention_launches", "record_sampling_launches",
           "compile_launch", "compile_tilelang", "build"]
