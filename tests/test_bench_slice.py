"""bench/bench_slice.py: the full-width slice's shapes and roofline arithmetic, and the whole script at --small on
the CPU (the sm90 plan's kernels under Triton's interpreter, against the cpu target's code)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import bench_slice  # noqa: E402

from deepinfer.models import DeepseekV41Flash  # noqa: E402


@pytest.fixture(scope="module")
def full():
    config = bench_slice.slice_config()
    return config, DeepseekV41Flash(config, bench_slice.slice_weights(config, "meta")).params()


def test_the_slice_has_the_real_widths_and_one_layer_of_each_kind(full) -> None:
    config, params = full
    assert [config.layer_kind(i) for i in range(4)] == ["window", "encoder", "decoder", "decoder"]
    c = config
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank) == (5120, 64, 512, 1280)
    assert (config.o_groups, config.o_lora_rank, config.vocab_size, config.hc_mult) == (8, 1024, 129280, 4)
    assert (config.sliding_window, config.index_topk, config.candidate_source_layer_id) == (128, 512, 2)
    w1 = params["layers.3.ffn.experts.w1.weight"]
    assert tuple(w1.shape) == (384, 2304, 2560) and str(w1.dtype) == "torch.uint8"  # fp4, two codes a byte
    assert str(params["layers.0.attn.wq_b.weight"].dtype) == "torch.float8_e4m3fn"
    assert "layers.1.attn.compressor.wgate.weight" in params and "layers.2.attn.compressor.wgate.weight" not in params
    assert "layers.3.attn.compressor.wkv.weight" not in params and "layers.3.attn.indexer.wq_b.weight" not in params


def test_roofline_counts_the_bytes_a_step_must_read(full) -> None:
    config, params = full
    assert bench_slice.expected_experts(config, 1) == pytest.approx(6)
    assert 370 < bench_slice.expected_experts(config, 256) < 384
    decode = {c.batch: bench_slice.roofline(config, params, c) for c in bench_slice.cases(False) if c.kind == "decode"}
    # KV of one sequence at 1024 cached tokens: 4 windows of 128 fp8 entries (528 B), 3 layers' 512 picked fp4 entries
    # (288 B), the indexer keys (68 B) of both index sources (512 entries at ratio 2, 1025 at ratio 1)
    assert decode[1]["kv_GB"] * 1e9 == pytest.approx(4 * 128 * 528 + 3 * 512 * 288 + (512 + 1025) * 68)
    head = 129280 * 5120 * 2
    expert = 3 * (2304 * 2560 + 2304 * 160 * 4)  # fp4 codes + fp32 scales per 32
    assert head + 4 * 6 * expert < decode[1]["weight_GB"] * 1e9 < head + 4 * 6 * expert + 1e9
    assert decode[1]["weight_GB"] < decode[16]["weight_GB"] < decode[64]["weight_GB"] < decode[256]["weight_GB"] < 36
    assert all(r["mem_us"] > r["compute_us"] for r in decode.values())
    prefill = bench_slice.roofline(config, params, bench_slice.Case("prefill", 1, 8192, 0))
    assert prefill["compute_us"] > prefill["mem_us"] and prefill["roof_us"] == prefill["compute_us"]


def test_small_run_on_the_cpu(tmp_path) -> None:
    """One decode step at --small: the sm90 plan (Triton interpreter, fp32 products) and the cpu target's code give
    the same logits, both time the step, and the table prints."""
    out = tmp_path / "slice.json"
    # The in-place attention decodes fp8 through bf16 subnormals, which Triton's interpreter widens to zero unless
    # tests/kernels/conftest.py patches it, and this process is not patched: its attention gathers (the in-place
    # kernels have their own tests, under the patched interpreter and on the GPU).
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", DEEPINFER_PAGED_ATTENTION="0")
    done = subprocess.run([sys.executable, "bench/bench_slice.py", "--small", "--paths", "sm90,eager", "--cases",
                           "decode B=1", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["path"]: r for r in result["rows"]}
    assert set(rows) == {"sm90", "eager"} and all(r["us"] > 0 and r["tok_s"] > 0 for r in rows.values())
    assert rows["sm90"]["rel_l2"] == 0 and rows["eager"]["rel_l2"] < 1e-4  # vs the first path, sm90
    assert set(result["roofline"]) == {"decode B=1 ctx=8"}
    assert "x eager" in done.stdout and "decode B=1 ctx=8" in done.stdout.splitlines()[-1]
