"""Checkpoint loading: the fixtures, sharding, name spellings, quantized weights, and damaged checkpoints."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from deepinfer.checkpoint import CheckpointError, canonical_name, load_checkpoint, save_checkpoint
from deepinfer.config import ConfigError, DeepseekV41Config
from deepinfer.models.weights import expected_weights
from dsl.quant import dequantize, quantize_fp4_group, quantize_fp8_block, quantize_fp8_group

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_NAMES = ["v41-smooth", "v41-smooth-engram", "v41-tiny", "v41-tiny-engram"]
BASE = FIXTURES / "v41-tiny"


def _tensors(name: str = "v41-tiny") -> dict[str, torch.Tensor]:
    return load_file(FIXTURES / name / "model.safetensors")


def _write(directory: Path, tensors: dict[str, torch.Tensor], fixture: Path = BASE, **kwargs) -> Path:
    save_checkpoint(tensors, directory, **kwargs)
    shutil.copy(fixture / "config.json", directory / "config.json")
    return directory


def _fails(path: Path, *fragments: str, config: DeepseekV41Config | None = None) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, config)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_loads_as_stored(name: str) -> None:
    stored = _tensors(name)
    loaded = load_checkpoint(FIXTURES / name)
    assert loaded.keys() == stored.keys()
    for key, t in stored.items():
        assert loaded[key].dtype == t.dtype and torch.equal(loaded[key], t), key
    config = DeepseekV41Config.from_pretrained(FIXTURES / name)
    assert loaded.keys() == {k for k, s in expected_weights(config).items() if not s.optional}


def test_sharded_round_trip(tmp_path: Path) -> None:
    tensors = _tensors()
    _write(tmp_path, tensors, max_shard_bytes=200_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and all((tmp_path / s).is_file() for s in shards)
    assert not (tmp_path / "model.safetensors").exists()
    loaded = load_checkpoint(tmp_path)
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())
    single = tmp_path / f"model-00001-of-{len(shards):05d}.safetensors"  # one shard alone is incomplete
    _fails(single, "missing tensors", "norm.weight", config=DeepseekV41Config.from_pretrained(tmp_path))


def test_single_file_without_config_needs_a_config(tmp_path: Path) -> None:
    save_checkpoint(_tensors(), tmp_path)
    with pytest.raises(ConfigError, match="config.json"):
        load_checkpoint(tmp_path / "model.safetensors")
    loaded = load_checkpoint(tmp_path / "model.safetensors", DeepseekV41Config.from_pretrained(BASE))
    assert "head.weight" in loaded


def test_model_prefix_and_lm_head_accepted(tmp_path: Path) -> None:
    tensors = _tensors()
    renamed = {("lm_head.weight" if k == "head.weight" else f"model.{k}"): t for k, t in tensors.items()}
    renamed["model.vision.blocks.0.attn.wqkv.weight"] = torch.zeros(2, 2)  # other modalities are ignored
    renamed["image_newline"] = torch.zeros(2)
    loaded = load_checkpoint(_write(tmp_path, renamed))
    assert loaded.keys() == tensors.keys()
    assert torch.equal(loaded["head.weight"], tensors["head.weight"])


def test_canonical_names() -> None:
    assert canonical_name("model.layers.0.attn.wq_a.weight_scale_inv") == "layers.0.attn.wq_a.scale"
    assert canonical_name("layers.0.attn.wq_a.weight.scale") == "layers.0.attn.wq_a.scale"
    assert canonical_name("layers.1.engram.embed.scale") == "layers.1.engram.embed.scale"
    assert canonical_name("layers.1.hc_attn_scale") == "layers.1.hc_attn_scale"
    assert canonical_name("mtp.0.embed.weight") is None and canonical_name("aligner.w1.weight") is None


def _quantize(tensors: dict[str, torch.Tensor], config: DeepseekV41Config) -> dict[str, torch.Tensor]:
    """Store every quantizable weight quantized, alternating scale spellings and fp32 / ue8m0 scales."""
    specs, out = expected_weights(config), {}
    spellings = (".scale", ".weight_scale_inv", ".weight.scale")
    for i, (name, t) in enumerate(tensors.items()):
        spec = specs[name]
        if spec.quant is None:
            out.setdefault(name, t)
            continue
        if name.endswith("engram.embed.weight"):  # the table's scale is the model tensor `engram.embed.scale`
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp8_group(t.float())
            continue
        q, scale = (quantize_fp8_block if spec.quant == "fp8" else quantize_fp4_group)(t.float())
        if i % 2:
            scale = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)
        if spec.quant == "fp4" and i % 3 == 1:
            q = q.view(torch.int8)
        out[name] = q
        out[name.removesuffix(".weight") + spellings[i % 3]] = scale
    return out


@pytest.mark.parametrize("name", ["v41-tiny", "v41-tiny-engram"])
def test_quantized_checkpoint_loads_and_dequantizes_close(tmp_path: Path, name: str) -> None:
    tensors, config = _tensors(name), DeepseekV41Config.from_pretrained(FIXTURES / name)
    written = _quantize(tensors, config)
    loaded = load_checkpoint(_write(tmp_path, written, FIXTURES / name))
    specs = expected_weights(config)
    counts = {"fp8": 0, "fp4": 0}
    for key, t in tensors.items():
        spec = specs[key]
        if spec.quant is None:
            continue
        counts[spec.quant] += 1
        weight, scale = loaded[key], loaded[key.removesuffix(".weight") + ".scale"]
        assert weight.dtype == (torch.float8_e4m3fn if spec.quant == "fp8" else torch.uint8), key
        assert torch.equal(weight.view(torch.uint8), written[key].view(torch.uint8)), key
        value, original = dequantize(weight, scale), t.float()
        error = float((value - original).norm() / original.norm())
        assert error < (0.04 if spec.quant == "fp8" else 0.2), (key, error)
    assert counts["fp8"] >= 8 * 7 and counts["fp4"] == 8 * 8 * 3
    assert not any(k.endswith(("weight_scale_inv", ".weight.scale")) for k in loaded)


def test_draft_layers_expected_and_loaded(tmp_path: Path) -> None:
    config = DeepseekV41Config.from_pretrained(BASE).replace(num_nextn_predict_layers=2, dspark_markov_rank=16,
                                                             dspark_n_routed_experts=4)
    tensors, specs = _tensors(), expected_weights(config)
    _write(tmp_path, tensors)
    drafts = [k for k, s in specs.items() if k.startswith("mtp.") and not s.optional]
    _fails(tmp_path, f"missing tensors ({len(drafts)})", "mtp.0.hc_attn_fn", config=config)
    # per draft layer: hc 6, norms 2, attention 8, router 3, experts 4 x 3, shared 3; the first adds main_proj
    # and main_norm, the last norm, markov embed and head, confidence proj
    assert len(drafts) == 2 * 34 + 2 + 4
    assert specs["mtp.0.main_proj.weight"].shape == (64, 3 * 64)
    assert specs["mtp.1.confidence_head.proj.weight"].shape == (1, 64 + 16)
    assert specs["mtp.1.markov_head.head.weight"].shape == (512, 16)
    assert "mtp.0.ffn.experts.3.w2.weight" in specs and "mtp.0.ffn.experts.4.w2.weight" not in specs
    assert not any(k.startswith("mtp.") and ("compressor" in k or "indexer" in k) for k in specs)
    gen = torch.Generator().manual_seed(0)
    for key, spec in specs.items():
        if key.startswith("mtp.") and not spec.optional:
            tensors[key] = torch.randn(spec.shape, generator=gen).to(spec.dtype)
    tensors["mtp.0.embed.weight"] = tensors["embed.weight"]  # a tied copy: accepted and dropped
    loaded = load_checkpoint(_write(tmp_path / "full", tensors), config)
    assert "mtp.1.norm.weight" in loaded and "mtp.0.embed.weight" not in loaded


# --- damaged checkpoints --------------------------------------------------------------------------------------


def test_missing_tensors_listed(tmp_path: Path) -> None:
    tensors = _tensors()
    del tensors["layers.3.attn.wq_a.weight"]
    _fails(_write(tmp_path / "one", tensors), "missing tensors (1)", "layers.3.attn.wq_a.weight")
    tensors = {k: t for k, t in _tensors().items() if not k.startswith("layers.6.ffn.experts.")}
    _fails(_write(tmp_path / "many", tensors), "missing tensors (24)", "layers.6.ffn.experts.0.w1.weight",
           "and 14 more")


def test_unexpected_tensor_named(tmp_path: Path) -> None:
    tensors = _tensors()
    tensors["layers.0.attn.bogus.weight"] = torch.zeros(3)
    tensors["layers.0.ffn.gate.scale"] = torch.ones(1, 2)  # a scale beside a float weight is not used
    _fails(_write(tmp_path, tensors), "unexpected tensors (2)", "layers.0.attn.bogus.weight", "layers.0.ffn.gate.scale")


def test_misshapen_tensor_named(tmp_path: Path) -> None:
    tensors = _tensors()
    tensors["layers.2.attn.wq_a.weight"] = torch.zeros(32, 65, dtype=torch.bfloat16)
    _fails(_write(tmp_path, tensors), "misshapen", "layers.2.attn.wq_a.weight: expected [32, 64], got [32, 65]")


def test_config_that_does_not_match_the_weights(tmp_path: Path) -> None:
    config = DeepseekV41Config.from_pretrained(BASE).replace(q_lora_rank=48)
    _fails(_write(tmp_path, _tensors()), "misshapen", "layers.0.attn.wq_b.weight: expected [256, 48]", config=config)


def test_wrong_dtypes_named(tmp_path: Path) -> None:
    config = DeepseekV41Config.from_pretrained(BASE)
    tensors = _tensors()
    tensors["layers.1.ffn.gate.bias"] = torch.zeros(8, dtype=torch.int32)
    tensors["layers.1.ffn.gate.weight"] = quantize_fp8_block(tensors["layers.1.ffn.gate.weight"].float())[0]
    tensors["layers.2.attn.wo_b.weight"] = quantize_fp8_block(tensors["layers.2.attn.wo_b.weight"].float())[0]
    q, _ = quantize_fp8_block(tensors["layers.3.attn.wq_a.weight"].float())
    tensors["layers.3.attn.wq_a.weight"], tensors["layers.3.attn.wq_a.scale"] = q, torch.ones(3, 3)
    q, s = quantize_fp4_group(tensors["layers.4.ffn.experts.0.w1.weight"].float())
    tensors["layers.4.ffn.experts.0.w1.weight"], tensors["layers.4.ffn.experts.0.w1.scale"] = q, s.int()
    _fails(_write(tmp_path, tensors), "wrong dtype",
           "layers.1.ffn.gate.bias: expected float32/bfloat16/float16, got int32",
           "layers.1.ffn.gate.weight: expected float32/bfloat16/float16, got float8_e4m3fn",
           "layers.2.attn.wo_b.weight: stored as fp8 but its scale layers.2.attn.wo_b.scale is missing",
           "layers.3.attn.wq_a.scale (scale of layers.3.attn.wq_a.weight): expected [1, 2], got [3, 3]",
           "layers.4.ffn.experts.0.w1.scale: expected float32 or float8_e8m0fnu", config=config)


def test_truncated_file_named(tmp_path: Path) -> None:
    file = _write(tmp_path, _tensors()) / "model.safetensors"
    os.truncate(file, file.stat().st_size - 100)
    _fails(tmp_path, "truncated file", str(file))


@pytest.mark.parametrize("damage", ["garbage", "huge_length", "trailing"])
def test_corrupt_file_named(tmp_path: Path, damage: str) -> None:
    file = _write(tmp_path, _tensors()) / "model.safetensors"
    data = bytearray(file.read_bytes())
    if damage == "garbage":
        data[8:24] = b"\xff" * 16
        expected = "corrupt header in"
    elif damage == "huge_length":
        data[:8] = (10**12).to_bytes(8, "little")
        expected = "corrupt header or truncated file"
    else:  # the header is sound but the data does not match it: safetensors' own error, with the file's name
        data += b"\0" * 16
        expected = "cannot read"
    file.write_bytes(bytes(data))
    _fails(tmp_path, expected, str(file))


def test_missing_shard_named(tmp_path: Path) -> None:
    _write(tmp_path, _tensors(), max_shard_bytes=300_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    _fails(tmp_path, "missing shard", shard.name)


def test_index_pointing_to_the_wrong_shard(tmp_path: Path) -> None:
    _write(tmp_path, _tensors(), max_shard_bytes=300_000)
    index_file = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    wrong = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"]["norm.weight"])
    index["weight_map"]["norm.weight"] = wrong
    index_file.write_text(json.dumps(index))
    _fails(tmp_path, "lacks them", wrong, "norm.weight")
    index_file.write_text("{not json")
    _fails(tmp_path, "corrupt index")


def test_directory_without_weights(tmp_path: Path) -> None:
    shutil.copy(BASE / "config.json", tmp_path / "config.json")
    _fails(tmp_path, "no model.safetensors")


@pytest.mark.parametrize("edit, fragment", [
    (lambda c: c.pop("engram_num_embeddings"), "engram_num_embeddings"),  # missing where Engram layers need it
    (lambda c: c.update(hidden_size="64"), "hidden_size"),  # ill-typed
    (lambda c: c.update(num_experts_per_tok=9), "num_experts_per_tok"),  # inconsistent with n_routed_experts
    (lambda c: c.update(kv_source_layer_ids=[0, 5]), "kv_source_layer_ids"),  # a source with no compression
    (lambda c: c.pop("hidden_size"), "config has no `hidden_size`"),  # not the 5120 default and 289 misshapen tensors
    (lambda c: c.update(rope_theta=0), "rope_theta"),
    (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (lambda c: c.update(eos_token_id="1"), "eos_token_id"),
])
def test_bad_config_rejected(tmp_path: Path, edit, fragment: str) -> None:
    raw = json.loads((FIXTURES / "v41-tiny-engram" / "config.json").read_text())
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shutil.copy(FIXTURES / "v41-tiny-engram" / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match=fragment):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("name,dtype,value", [
    ("layers.0.attn.wq_a.weight", torch.float32, float("nan")),
    ("layers.1.ffn.gate.weight", torch.bfloat16, float("inf")),
    ("norm.weight", torch.float32, float("-inf")),
])
def test_weights_that_are_not_finite_are_named(tmp_path: Path, name: str, dtype: torch.dtype, value: float) -> None:
    tensors = _tensors()
    t = tensors[name].to(dtype).clone()
    t.view(-1)[3] = value
    tensors[name] = t
    _fails(_write(tmp_path, tensors), "has NaN or inf values in 1 tensor(s)", f"{name} (1 of {t.numel()} values)")


def test_fp8_nan_codes_are_found() -> None:
    from deepinfer.checkpoint import check_finite

    codes = torch.zeros(4, 32, dtype=torch.uint8)
    codes[1, 5] = 0xFF  # e4m3fn's NaN, negative
    with pytest.raises(CheckpointError, match="w.weight \\(1 of 128 values\\)"):
        check_finite({"w.weight": codes.view(torch.float8_e4m3fn), "w.scale": torch.ones(1, 1)})
    check_finite({"w.weight": torch.full((4, 32), 0x7E, dtype=torch.uint8).view(torch.float8_e4m3fn)})  # 448: finite


def test_missing_config_rejected(tmp_path: Path) -> None:
    save_checkpoint(_tensors(), tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(tmp_path)
