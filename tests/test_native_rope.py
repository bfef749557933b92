"""rope's rotation in C (dsl/native.c) gives the bits of its torch code (dsl/ops/rope.py's `_rotated`), for the
shapes the ops pass (x [T, D] and [T, heads, D], a part of D left unrotated or none), forward and inverse."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dsl import native
from dsl.ops import rope as rope_ops
from dsl.ops.rope import rotation_at

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH")


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize(("shape", "rope_dim"), [((5, 64), 64), ((7, 192), 64), ((3, 4, 96), 32), ((1, 8, 64), 64),
                                                 ((0, 2, 64), 16)])
def test_c_rope_is_torch_bit_for_bit(shape: tuple, rope_dim: int, inverse: bool, monkeypatch) -> None:
    g = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = torch.randn(*shape, generator=g) * 3
    x.view(-1)[:7] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3e38, float("inf"), float("nan")])[: x.numel()]
    positions = torch.randint(0, 1 << 20, (shape[0],), generator=g)
    freqs = 10000.0 ** (-torch.arange(0, rope_dim, 2).float() / rope_dim)
    rotation = rotation_at(positions, freqs, 1.25, inverse)
    for _ in range(x.dim() - 2):
        rotation = rotation.unsqueeze(1)  # as the rope op hands it over
    assert native.rope(x, rotation) is not None, native.reason()
    got = rope_ops._rotated(x, rotation)
    monkeypatch.setattr(native, "library", lambda: None)
    expected = rope_ops._rotated(x, rotation)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_other_inputs_keep_the_torch_code() -> None:
    x, rotation = torch.randn(4, 64), rotation_at(torch.arange(4), torch.ones(32), 1.0, False)
    assert native.rope(x.bfloat16(), rotation) is None
    assert native.rope(x[:, ::2], rotation[:, :16]) is None
    assert native.rope(x, rotation[:1]) is None  # one rotation broadcast over the tokens
    assert native.rope(x[:, :48], rotation) is None  # more pairs than dims
