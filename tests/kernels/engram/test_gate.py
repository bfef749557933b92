"""Engram's gate kernel against `dsl.ops.engram.engram_gate`, and its rows' independence of the batch."""

from __future__ import annotations

import pytest
import torch

from dsl.ops import engram as ref
from kernels.engram.gate import engram_gate
from tests.kernels.cases import HIDDEN, gen, rel_l2

HC, EPS = 4, 1e-20


def gate_inputs(n: int, d: int, device: str) -> tuple[torch.Tensor, ...]:
    h = gen(n, HC, d, device=device, seed=n)
    kv = gen(n, (HC + 1) * d, device=device, seed=n + 1)
    q = gen(HC, d, device=device, seed=2).to(torch.bfloat16)  # the checkpoint's dtype; the kernel takes fp32
    k = gen(HC, d, device=device, seed=3).to(torch.bfloat16)
    return h, kv, q, k


def check_gate(n: int, d: int, device: str) -> None:
    h, kv, q, k = gate_inputs(n, d, device)
    got = engram_gate(h, kv, q.float(), k.float(), eps=EPS)
    want = ref.engram_gate(h.cpu(), kv.cpu(), q.cpu(), k.cpu(), eps=EPS)
    assert got.shape == want.shape == (n, HC, d)
    assert rel_l2(got, want) < 1e-6


@pytest.mark.parametrize("n,d", [(1, 64), (5, 40), (3, 1100)])
def test_engram_gate_matches_reference(n, d, device) -> None:
    check_gate(n, d, device)


def test_engram_gate_rows_do_not_depend_on_the_batch(device) -> None:
    """A token's output is bitwise the same alone, in a batch, and with padding rows (NaN) after it."""
    h, kv, q, k = gate_inputs(6, 96, device)
    q, k = q.float(), k.float()
    batch = engram_gate(h, kv, q, k, eps=EPS)
    alone = engram_gate(h[2:3].contiguous(), kv[2:3].contiguous(), q, k, eps=EPS)
    assert torch.equal(alone[0], batch[2])
    padded_h = torch.cat([h, torch.full((10, HC, 96), float("nan"), device=device)])
    padded_kv = torch.cat([kv, torch.full((10, (HC + 1) * 96), float("nan"), device=device)])
    assert torch.equal(engram_gate(padded_h, padded_kv, q, k, eps=EPS)[:6], batch)


def test_engram_gate_checks_its_inputs(device) -> None:
    h, kv, q, k = gate_inputs(2, 32, device)
    with pytest.raises(ValueError, match="kv must be contiguous float32 \\[2, 160\\]"):
        engram_gate(h, kv[:, :128].contiguous(), q.float(), k.float(), eps=EPS)
    with pytest.raises(ValueError, match="q_weight must be contiguous float32"):
        engram_gate(h, kv, q, k.float(), eps=EPS)
    with pytest.raises(ValueError, match="streams"):
        engram_gate(h.double(), kv, q.float(), k.float(), eps=EPS)
    assert engram_gate(h[:0], kv[:0], q.float(), k.float(), eps=EPS).shape == (0, HC, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 513])
def test_engram_gate_v41_shapes(n) -> None:
    check_gate(n, HIDDEN, "cuda")
