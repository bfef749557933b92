from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run under Triton's interpreter on CPU tensors; it must be chosen before Triton is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

FIXTURES = Path(__file__).parent / "fixtures"
SMOOTH = ["v41-smooth", "v41-smooth-engram"]
DISCRETE = ["v41-tiny", "v41-tiny-engram"]


def fixture_dir(name: str) -> Path:
    return FIXTURES / name


def oracle(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "oracle.npz") as data:
        return {k: data[k] for k in data.files}


def spread(name: str) -> dict:
    return json.loads((FIXTURES / name / "spread.json").read_text())


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


_COMPILED: dict = {}


@pytest.fixture(scope="session")
def compiled_fixture():
    """compiled_fixture(name) -> the fixture compiled for the cpu target, built once per session."""
    import deepinfer
    from deepinfer.models import DeepseekV41Flash

    def get(name: str):
        if name not in _COMPILED:
            _COMPILED[name] = deepinfer.compile(DeepseekV41Flash.from_pretrained(fixture_dir(name)), target="cpu")
        return _COMPILED[name]

    return get


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked `slow` run first, so that workers in parallel (`-n`, pytest-xdist) start them together rather
    than one worker ending the run alone on them. Tests marked `gpu` need CUDA: skipped where there is none (CI)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: each group keeps its order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
