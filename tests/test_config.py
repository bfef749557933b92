"""The config: the per-layer schedule derived as the reference derives it, nested configs, replace()."""

from __future__ import annotations

import json

import pytest

from deepinfer.config import ConfigError, DeepseekV41Config
from tests.conftest import fixture_dir


def test_released_schedule() -> None:
    c = DeepseekV41Config()
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert c.kv_source_layer_ids == (2, 8, 14, 20)
    assert c.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert c.candidate_source_layer_id == 20
    assert c.dspark_target_layer_ids == (37, 38, 39)
    assert [c.kv_source_of(i) for i in (2, 7, 8, 19, 20, 39)] == [2, 2, 8, 14, 20, 20]
    assert [c.layer_kind(i) for i in (0, 2, 20)] == ["window", "encoder", "decoder"]
    compress = c.rope_parameters["compress"]
    assert compress["rope_type"] == "default" and compress["rope_theta"] == 160000.0


def test_small_schedule_has_every_kind_of_layer() -> None:
    c = DeepseekV41Config(num_hidden_layers=8, num_nextn_predict_layers=0)
    assert c.compress_ratios == (0, 0, 2, 2, 2, 1, 1, 1)
    assert c.kv_source_layer_ids == (2, 5) and c.index_source_layer_ids == (2, 5)
    assert c.candidate_source_layer_id == 5


def test_nested_text_config_with_quantization(tmp_path) -> None:
    flat = json.loads((fixture_dir("v41-tiny") / "config.json").read_text())
    nested = {"text_config": flat, "vision_config": {"hidden_size": 1024},
              "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32]}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    c = DeepseekV41Config.from_pretrained(tmp_path)
    assert c == DeepseekV41Config.from_dict(flat)
    assert c.quantization_config["quant_method"] == "fp8"


def test_replace_rederives_the_schedule() -> None:
    c = DeepseekV41Config().replace(num_hidden_layers=8, num_nextn_predict_layers=0)
    assert c.compress_ratios == (0, 0, 2, 2, 2, 1, 1, 1)
    assert c.replace(index_topk=7).compress_ratios == c.compress_ratios


@pytest.mark.parametrize("fields,fragment", [
    ({"compress_ratios": [0, 2, 1]}, "compress_ratios"),
    ({"num_hidden_layers": 8, "kv_source_layer_ids": [0]}, "kv_source_layer_ids"),
    ({"num_hidden_layers": 8, "candidate_source_layer_id": 3}, "candidate_source_layer_id"),
    ({"num_hidden_layers": 8, "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1], "kv_source_layer_ids": [2]}, "ratio"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"rope_scaling": {"rope_type": "yarn"}}, "yarn needs"),
    ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers"),
    ({"rope_theta": 0}, "`rope_theta` must be a finite number > 0"),
    ({"compress_rope_theta": -5.0}, "compress_rope_theta"),
    ({"rms_norm_eps": -1e-6}, "`rms_norm_eps` must be a finite number > 0"),
    ({"hc_eps": 0}, "hc_eps"),
    ({"eos_token_id": "1"}, "`eos_token_id` must be a token id"),
    ({"eos_token_id": [1, -2]}, "`eos_token_id` must be a token id"),
    ({"bos_token_id": "<s>"}, "bos_token_id"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"dspark_noise_token_id": 129280}, "dspark_noise_token_id"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 4096}}, "`factor`"),
    ({"swiglu_limit": float("inf")}, "swiglu_limit"),
])
def test_inconsistent_configs_name_the_field(fields: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        DeepseekV41Config.from_dict(fields)


@pytest.mark.parametrize("name", ["hidden_size", "vocab_size", "num_hidden_layers", "head_dim", "n_routed_experts"])
def test_a_config_without_a_field_the_weights_depend_on_names_it(name: str) -> None:
    raw = json.loads((fixture_dir("v41-tiny") / "config.json").read_text())
    DeepseekV41Config.from_dict(raw)
    del raw[name]
    with pytest.raises(ConfigError, match=f"config has no `{name}`: the weights' shapes depend on it"):
        DeepseekV41Config.from_dict(raw)
