"""Prefill buckets of the linear family run the prefill GEMM (kernels/linear/lowering.py): which buckets and formats
take it, block-diagonal groups a group at a time, plans that multiply in fp32 kept on linear.py, and the launches
the ahead-of-time builder records for them."""

from __future__ import annotations

import pytest
import torch

import kernels.linear.linear as linear
from deepinfer.models import DeepseekV41Flash
from dsl.passes import run_passes
from dsl.quant import quantize_fp8_block
from graphs.aot import record_launches
from graphs.passes import make_plan
from kernels.linear.lowering import DECODE, PREFILL, gemm_config, gemm_for, project
from tests.conftest import fixture_dir, rel_l2

SMALL = {"block_M": 16, "block_N": 32, "block_K": 64, "group_M": 2, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("m,n,groups,fmt,prefill", [
    (64, 32768, 1, "plain", False),  # decode buckets: linear.py, tuned
    (128, 32768, 1, "plain", True),  # wq_b: 256 output tiles at 128 tokens
    (128, 5120, 1, "fp8", False),  # wo_b: 40 tiles, but the fp8 weight's bf16 copy is not paid back yet
    (256, 5120, 1, "fp8", True),
    (256, 1280, 1, "plain", False),  # wq_a: 20 tiles
    (512, 1280, 1, "plain", True),  # 40 tiles
    (1024, 512, 1, "plain", False),  # wkv: 32 tiles
    (1024, 1024, 8, "plain", False),  # wo_a, one launch a group
    (8192, 1024, 8, "fp8", True),
])
def test_which_buckets_take_the_prefill_gemm(m, n, groups, fmt, prefill) -> None:
    assert (gemm_for(m, n, groups, fmt, dot_fp32=False) == PREFILL) == prefill
    assert gemm_for(m, n, groups, fmt, dot_fp32=True) == DECODE  # fp32 products
    assert gemm_config(DECODE, m, n, 512, groups, fmt) == linear.default_config(m, n, 512, groups, fmt == "fp8")
    if prefill:
        assert gemm_config(PREFILL, m, n, 512, groups, fmt)["block_K"] == 64


@pytest.mark.parametrize("fmt", ["plain", "fp8"])
def test_groups_run_one_at_a_time(fmt) -> None:
    """A block-diagonal linear (wo_a) of 2 groups: each group through its rows of W (and its scale blocks)."""
    groups, n, k, m = 2, 64, 96, 9
    w = torch.randn(groups * n, k) * k**-0.5
    w, s = quantize_fp8_block(w) if fmt == "fp8" else (w.bfloat16(), None)
    x = torch.randn(m, groups * k)
    got = project(x, w, s, PREFILL, SMALL, dot_fp32=False, groups=groups)
    decode = linear.default_config(m, n, k, groups, fmt == "fp8")
    want = linear.linear(x, w, s, groups=groups, config=decode)  # the same bf16 products, summed otherwise
    assert got.shape == (m, groups * n) and rel_l2(got, want) < 1e-5


def test_the_builder_records_the_prefill_launches_and_fp32_plans_keep_linear() -> None:
    model = DeepseekV41Flash.from_pretrained(fixture_dir("v41-smooth"))
    graph, params = run_passes(model.graph()), model.params()
    attrs = {i: node.attrs for i, node in enumerate(graph.nodes)}
    names = {key.split("|")[0] for key in record_launches(make_plan(graph, params, "sm90", (16, 8192)), attrs)}
    assert any("linear_prefill" in name for name in names), names
    exact = make_plan(graph, params, "sm90", (16, 8192), dot_fp32=True)
    assert not any("linear_prefill" in key for key in record_launches(exact, attrs))
