"""Tuning: config spaces within hardware limits, the cache and its keys, rejection of wrong candidates, and the
committed H200 tuning file matching the kernels it was measured on."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from autotune import choose, get_configs
from autotune.cache import TUNED_DIR, TuningCache, cache_key, source_hash
from autotune.space import SMEM_LIMIT
from autotune.tune import tune

MODULES = {"linear": "linear", "moe_experts": "moe", "sparse_attention": "attention", "hc_mixes": "hyper"}
LINEAR = {"n": 5120, "k": 8192, "groups": 1, "fmt": "fp8"}


@pytest.mark.parametrize("bucket", [16, 64, 8192])
def test_linear_space_respects_shared_memory_and_fp8_blocks(bucket) -> None:
    configs = get_configs("linear", LINEAR, bucket)
    assert configs
    for c in configs:
        assert c["num_stages"] * c["block_K"] * (c["block_N"] + c["block_M"] * 4) <= SMEM_LIMIT["sm90"]
        assert c["block_N"] % 32 == 0 and c["block_K"] % 32 == 0
        assert c["split_k"] == 1 or LINEAR["k"] // c["split_k"] >= 2 * c["block_K"]


def test_cache_round_trip_and_fallback(tmp_path) -> None:
    cache = TuningCache(tmp_path / "t.json")
    src = source_hash(importlib.import_module("kernels.triton.linear"))
    key = cache_key("linear", LINEAR, 16, "sm90", "NVIDIA H200", src)
    assert choose("linear", LINEAR, 16, "sm90", src, lambda: {"h": 1}, cache) == ({"h": 1}, "heuristic")
    cache.put(key, {"block_N": 64}, 12.5)
    cache.save()
    again = TuningCache(tmp_path / "t.json")
    assert choose("linear", LINEAR, 16, "sm90", src, lambda: {"h": 1}, again) == ({"block_N": 64}, "tuned")
    # another device or an edited kernel misses
    assert choose("linear", LINEAR, 16, "sm90", src, lambda: {}, again, device="NVIDIA B200")[1] == "heuristic"
    assert choose("linear", LINEAR, 16, "sm90", "0" * 16, lambda: {}, again)[1] == "heuristic"


def test_tune_rejects_configs_whose_output_is_wrong() -> None:
    ref = torch.ones(4)
    best, trials = tune([{"a": 1}, {"a": 2}], lambda c: ref * c["a"] + 1, ref, tol=1e-3)
    assert best is None and all(t.us is None and "rel_l2" in t.error for t in trials)


def test_committed_h200_tuning_matches_the_kernels() -> None:
    """Every entry of autotune/tuned/sm90.json was measured on the kernels as they are: an edited kernel source
    needs `python -m autotune.run` on an H200 again (bench/run_gpu.sh with TUNE=1)."""
    entries = json.loads((TUNED_DIR / "sm90.json").read_text())["configs"]
    assert len(entries) >= 20
    for key in entries:
        template, _, _, target, device, src = key.split("|")
        module = importlib.import_module(f"kernels.triton.{MODULES[template]}")
        assert (target, device) == ("sm90", "NVIDIA H200")
        assert src == source_hash(module), f"{key}: the {template} kernels changed since they were tuned"
