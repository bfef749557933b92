"""Prefill buckets of the linear family run the prefill GEMM (graphs/lowering_linear.py): which buckets and formats
take it, block-diagonal groups a group at a time, plans that multiply in fp32 kept on linear.py, and the launches
the ahead-of-time builder records for them."""

from __future__ import annotations

import pytest
import torch

import kernels.triton.linear as linear
from deepinfer.models import DeepseekV41Flash
from dsl.passes import run_passes
from dsl.quant import quantize_fp8_block
from graphs.aot import record_launches
from graphs.capture import BUCKETS
from graphs.lowering_linear import _config, _project
from graphs.plan import make_plan
from kernels.triton.linear_prefill import AFTER_TOKENS
from tests.conftest import fixture_dir, rel_l2

SMALL = {"block_M": 16, "block_N": 32, "block_K": 64, "group_M": 2, "num_warps": 4, "num_stages": 2}


def test_prefill_buckets_take_the_prefill_gemm() -> None:
    assert "prefill" not in _config(512, 1024, 512, "plain") and "prefill" not in _config(512, 1024, 512, "fp8")
    for m, fmt in ((8192, "fp8"), (8192, "plain")):
        config = _config(m, 1024, 512, fmt)
        assert config["linear"] == linear.default_config(m, 1024, 512, 1, fmt == "fp8")  # for fp32 products
        assert config["prefill"]["block_K"] == 64
    assert AFTER_TOKENS == BUCKETS[-1]  # beyond what CUDA graphs capture: those steps run unpadded


@pytest.mark.parametrize("fmt", ["plain", "fp8"])
def test_groups_run_one_at_a_time(fmt) -> None:
    """A block-diagonal linear (wo_a) of 2 groups: each group through its rows of W (and its scale blocks)."""
    groups, n, k, m = 2, 64, 96, 9
    w = torch.randn(groups * n, k) * k**-0.5
    w, s = quantize_fp8_block(w) if fmt == "fp8" else (w.bfloat16(), None)
    x = torch.randn(m, groups * k)
    config = {"prefill": SMALL, "linear": linear.default_config(m, n, k, groups, fmt == "fp8")}
    got = _project(x, w, s, config, dot_fp32=False, groups=groups)
    want = linear.linear(x, w, s, groups=groups, config=config["linear"])  # the same bf16 products, summed otherwise
    assert got.shape == (m, groups * n) and rel_l2(got, want) < 1e-5


def test_the_builder_records_the_prefill_launches_and_fp32_plans_keep_linear() -> None:
    model = DeepseekV41Flash.from_pretrained(fixture_dir("v41-smooth"))
    graph, params = run_passes(model.graph()), model.params()
    attrs = {i: node.attrs for i, node in enumerate(graph.nodes)}
    names = {key.split("|")[0] for key in record_launches(make_plan(graph, params, "sm90", (16, 8192)), attrs)}
    assert any("linear_prefill" in name for name in names), names
    exact = make_plan(graph, params, "sm90", (16, 8192), dot_fp32=True)
    assert not any("linear_prefill" in key for key in record_launches(exact, attrs))
