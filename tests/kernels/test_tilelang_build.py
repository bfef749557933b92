"""TileLang kernels with no GPU (CI): every one lowers and compiles for sm_90a and sm_100a with its launch spec, the
kernel's grid is checked against its wrapper's, and the sm90 plan serves its ops with them where TileLang builds."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from graphs.aot import build, record_launches
from kernels.hyper.collapse_tilelang import hc_collapse_rms_norm
from kernels.launch import Launch
from kernels.norm.rms_norm_tilelang import rms_norm
from kernels.tilelang_build import available, launch_shape, lower
from kernels.tilelang_kernel import TileLangKernel
from tests.kernels.tilelang_cubins import record
from tests.test_gpu_targets import cubin_arch, planned

# Where tilelang is installed (CI: a dependency) these must build, nvcc included; the GPU machine has none, and runs
# cubins built elsewhere
needs_tilelang = pytest.mark.skipif(importlib.util.find_spec("tilelang") is None, reason="tilelang is not installed")


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def one_launch(fn) -> Launch:
    (call,) = record(fn).values()
    return call


@needs_tilelang
def test_the_kernels_grid_is_checked_against_the_wrapper() -> None:
    call = one_launch(lambda: rms_norm(meta(7, 128), meta(128), eps=1e-6))  # 4 rows a block: 7 rows in 2 blocks
    _, function = lower(call, "sm_90a")
    names, threads, shared = launch_shape(call, function)
    assert names == ["W", "X", "Y", "m"] and threads == 128 and shared == 0  # a warp a row: shuffles only
    wrong = Launch(call.kernel, (7,), call.args, call.constexprs, call.num_warps, call.num_stages)
    with pytest.raises(ValueError, match="grid"):
        launch_shape(wrong, function)


@needs_tilelang
@pytest.mark.parametrize("target,arch", [("sm90", 90), ("sm100", 100)])
def test_every_kernel_lowers_and_compiles_for_sm90a_and_sm100a(target, arch, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    norm = one_launch(lambda: rms_norm(meta(7, 5120), meta(5120), eps=1e-20))
    narrow = one_launch(lambda: rms_norm(meta(7, 40, dtype=torch.bfloat16), eps=1e-20))  # no weight, D padded
    collapse = one_launch(lambda: hc_collapse_rms_norm(meta(7, 4, 5120), meta(7, 4), meta(5120), eps=1e-20))
    calls = {c.key(): c for c in (norm, narrow, collapse)}
    built = build(calls, target)
    for key, call in calls.items():
        b = built[key]
        assert cubin_arch(b.cubin) == arch and f".target sm_{arch}a" in b.ptx
        assert f".entry {b.spec['name']}" in b.ptx and b.spec["backend"] == "tilelang"
        assert b.spec["threads"] == 32 * call.num_warps and f"__launch_bounds__({b.spec['threads']}" in b.source
    # the device function's parameters in its own order, as indices into the launch's arguments
    spec = built[norm.key()].spec  # (X, W, Y, m)
    assert spec["arg_order"] == [1, 0, 2, 3] and spec["signature"] == ["*fp32", "*fp32", "*fp32", "i32"]
    assert spec["shared"] > 0  # 256 threads a row: the cross-warp sum goes through shared memory
    spec = built[narrow.key()].spec
    assert spec["arg_order"] == [0, 2, 3] and spec["signature"] == ["*bf16", "*fp32", "i32"]  # the weight unread
    assert built[collapse.key()].spec["arg_order"] == [0, 1, 2, 3, 4]  # (H, Pre, W, Y, n): already in its order
    again = build(calls, target)  # from the cache
    assert all(again[k].cubin == built[k].cubin and again[k].source == built[k].source for k in calls)


def test_the_sm90_plan_serves_its_ops_with_tilelang_where_it_builds(monkeypatch) -> None:
    graph, plan = planned("smooth")
    ops = {"rms_norm", "hc_collapse_rms_norm"}
    nodes = [n for n in plan.kernel_nodes() if n.op in ops]
    kernel = "tilelang" if available() else "triton"
    assert {n.op for n in nodes} == ops and all(n.variant.backend == kernel for n in nodes)
    calls = record_launches(plan, {i: node.attrs for i, node in enumerate(graph.nodes)}).values()
    names = {c.name for c in calls if isinstance(c.kernel, TileLangKernel)}
    assert names == ({"rms_norm_tilelang", "hc_collapse_rms_norm_tilelang"} if available() else set())
    monkeypatch.setenv("DEEPINFER_TILELANG", "0")
    _, plan = planned("smooth")
    assert all(n.variant.backend == "triton" for n in plan.kernel_nodes() if n.op in ops)
