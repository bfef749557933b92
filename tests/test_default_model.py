"""The random-weight small model: its schedule has every kind of layer, and its random weights are complete."""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.default_model import default_config, default_model, random_weights
from deepinfer.models.weights import expected_weights


def test_config_has_every_kind_of_layer() -> None:
    c = default_config()
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_nextn_predict_layers) == (129280, 256, 8, 3)
    assert [c.layer_kind(i) for i in range(8)] == ["window"] * 2 + ["encoder"] * 3 + ["decoder"] * 3
    assert c.kv_source_layer_ids == (2, 5) and c.index_source_layer_ids == (2, 5, 7)
    assert c.candidate_source_layer_id == 5 and c.engram_layer_ids == (1, 4)
    assert c.eos_token_ids == (1,) and c.head_dim % 32 == 0 and c.index_head_dim % 32 == 0
    assert c.rope_parameters["compress"]["rope_type"] == "yarn"


def test_random_weights_cover_the_checkpoint_with_its_dtypes() -> None:
    config = default_config()
    start = time.perf_counter()
    weights = random_weights(config, seed=0)
    elapsed = time.perf_counter() - start
    specs = expected_weights(config)
    assert set(weights) == {name for name, spec in specs.items() if not spec.optional}
    for name, w in weights.items():
        assert tuple(w.shape) == specs[name].shape and w.dtype == specs[name].dtype, name
        assert bool(torch.isfinite(w).all()), name
    assert elapsed < 5.0  # about 0.5 s on two cores: it runs at every start of the default model


def test_random_weights_follow_the_init_rules() -> None:
    weights = random_weights(default_config(), seed=0)
    std = {name: float(w.float().std()) for name, w in weights.items() if w.numel() > 1000}
    assert std["layers.2.attn.wq_b.weight"] == pytest.approx(64**-0.5, rel=0.05)  # N(0, 1/fan_in), fan_in 64
    assert std["embed.weight"] == pytest.approx(1.0, rel=0.02)
    assert std["layers.0.hc_attn_fn"] == pytest.approx(0.02, rel=0.05)
    assert torch.equal(weights["layers.0.attn_norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    assert torch.equal(weights["layers.3.hc_ffn_scale"], torch.ones(3))
    for zero in ("layers.3.hc_ffn_base", "layers.4.attn.attn_sink", "layers.4.ffn.gate.bias"):
        assert not weights[zero].any(), zero


def test_random_weights_are_a_function_of_the_seed() -> None:
    config = default_config()
    a, b, c = random_weights(config, seed=3), random_weights(config, seed=3), random_weights(config, seed=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["head.weight"], c["head.weight"])


def test_llm_runs_the_random_model_given_as_an_object() -> None:
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    llm = LLM(default_model())  # LLM() alone runs the trained checkpoint (tests/test_trained_model.py)
    assert llm.config == default_config() and llm.tokenizer.vocab_size == 129280
    out = llm.generate("def fib(n):", SamplingParams(max_tokens=4, seed=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert all(0 <= t < 129280 for t in out.outputs[0].token_ids)
