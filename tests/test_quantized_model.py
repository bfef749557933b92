"""A checkpoint in the real fp8 / fp4 block formats, written by quantizing a fixture, runs end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer.config import DeepseekV41Config
from deepinfer.models import DeepseekV41Flash
from dsl.quant import dequantize
from tests.conftest import fixture_dir, oracle, rel_l2
from tests.test_checkpoint import _quantize, _tensors, _write


@pytest.mark.parametrize("name", ["v41-smooth", "v41-smooth-engram"])
def test_quantized_checkpoint_matches_its_dequantized_model(tmp_path: Path, name: str) -> None:
    config = DeepseekV41Config.from_pretrained(fixture_dir(name))
    path = _write(tmp_path, _quantize(_tensors(name), config), fixture_dir(name))
    quantized = DeepseekV41Flash.from_pretrained(path)
    assert any(t.dtype == torch.uint8 for t in quantized.weights.values())
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized.weights.values())

    dense = {}
    for key, t in quantized.weights.items():
        if key.endswith(".scale") and key.removesuffix(".scale") + ".weight" in quantized.weights:
            continue
        scale = quantized.weights.get(key.removesuffix(".weight") + ".scale") if key.endswith(".weight") else None
        dense[key] = dequantize(t, scale) if scale is not None else t
    dequantized = DeepseekV41Flash(config, dense, model_dir=str(path))

    ids = torch.from_numpy(oracle(name)["full_ids"]).long()
    got = deepinfer.compile(quantized, "cpu").forward(ids).numpy()
    want = deepinfer.compile(dequantized, "cpu").forward(ids).numpy()
    assert rel_l2(got, want) < 1e-5
    # Quantising the weights moves the logits, but not far: a check that the scales were applied at all.
    assert rel_l2(got, oracle(name)["full_logits"]) < 0.3
