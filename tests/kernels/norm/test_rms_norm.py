"""RMSNorm against `dsl.ops.dense.rms_norm`."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.dense import rms_norm as ref_rms_norm
from kernels.norm.rms_norm import rms_norm
from tests.kernels.cases import HIDDEN, Q_LORA, gen, rel_l2

EPS = 1e-20


def check(shape: tuple[int, ...], has_w: bool, dtype: torch.dtype, device: str) -> None:
    x = gen(*shape, dtype=dtype, device=device, seed=shape[0], scale=3.0)
    w = gen(shape[-1], device=device, seed=1) if has_w else None
    out = rms_norm(x, w, eps=EPS)
    ref = ref_rms_norm(x.cpu(), None if w is None else w.cpu(), eps=EPS)
    assert out.dtype == torch.float32 and out.shape == x.shape
    assert rel_l2(out, ref) < 1e-6


@pytest.mark.parametrize("shape", [(1, 64), (5, 40), (3, 2, 48)])
@pytest.mark.parametrize("has_w", [True, False])
def test_rms_norm_matches_reference(shape, has_w, device) -> None:
    check(shape, has_w, torch.float32, device)


def test_rms_norm_bf16_input_and_empty(device) -> None:
    check((4, 96), True, torch.bfloat16, device)
    assert rms_norm(torch.empty(0, 8, device=device), eps=EPS).shape == (0, 8)
    with pytest.raises(ValueError):
        rms_norm(gen(2, 8, device=device), gen(7, device=device), eps=EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [HIDDEN, Q_LORA, 512, 4 * HIDDEN])
@pytest.mark.parametrize("m", [1, 7, 64, 4097])
def test_rms_norm_v41_shapes(m, d) -> None:
    check((m, d), True, torch.float32, "cuda")
    check((m, d), False, torch.bfloat16, "cuda")
