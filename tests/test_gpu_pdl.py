"""Programmatic dependent launch on the GPU (graphs/launcher.py): the trained checkpoint's steps give bitwise the same
logits with it (`DEEPINFER_PDL=1`, the default) and without, run eagerly and replayed from CUDA graphs, every segment
still captures, and with it the kernels really are launched with programmatic stream serialization."""

from __future__ import annotations

import pytest
import torch

from deepinfer.default_model import TRAINED_CHECKPOINT
from tests.test_gpu_cuda_graphs import run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_programmatic_launches_give_the_same_logits(batch_invariant: bool, monkeypatch) -> None:
    import deepinfer
    from deepinfer.models import DeepseekV41Flash

    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)
    logits = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("DEEPINFER_PDL", pdl)
        for graphs in (False, True):
            compiled = deepinfer.compile(model, target="sm90")
            compiled.runtime.cuda_graphs = graphs
            logits[pdl, graphs] = run(compiled, batch_invariant=batch_invariant)
            launcher = compiled.runtime.launcher
            assert launcher.pdl is (pdl == "1")
            assert (launcher.programmatic > 0) is (pdl == "1") and launcher.programmatic <= launcher.launches
            if graphs:
                assert compiled.runtime.executors()[0].cuda_graphs.broken == set()
    expected = logits["0", False]
    for (pdl, graphs), got in logits.items():
        for step, (a, b) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(a, b), f"PDL {pdl}, graphs {graphs}: step {step}'s logits differ"
