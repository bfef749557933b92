"""The hyper-connection mixes' Sinkhorn loop in C (dsl/native.c) and in numpy (few tokens on the CPU, without a C
compiler) gives torch's bits, and the mixes of a token do not depend on how many tokens share the call, across the
size where numpy hands over to torch."""

from __future__ import annotations

import os
import shutil
import stat

import pytest
import torch

from dsl import native
from dsl.ops import hyper
from dsl.ops.hyper import NUMPY_SINKHORN_ROWS, invariant_hc_mixes, sinkhorn


@pytest.fixture
def without_c(monkeypatch):
    """The numpy and torch loops, as on a machine without a C compiler."""
    monkeypatch.setattr(native, "sinkhorn", lambda *args: False)


def torch_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The loop as the reference writes it."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, NUMPY_SINKHORN_ROWS])
@pytest.mark.parametrize("hc", [4, 3])
def test_numpy_sinkhorn_is_torch_bit_for_bit(rows: int, hc: int, without_c) -> None:
    g = torch.Generator().manual_seed(rows * 10 + hc)
    for _ in range(20):
        comb = torch.softmax(torch.randn(rows, hc, hc, generator=g) * 4, dim=-1) + 1e-6
        expected = torch_sinkhorn(comb, 20, 1e-6)
        assert torch.equal(sinkhorn(comb.clone(), 20, 1e-6), expected)


def test_the_numpy_loop_ran(without_c) -> None:
    """The small case really goes through numpy: the result is the input tensor, normalised in place."""
    comb = torch.softmax(torch.randn(2, 4, 4), dim=-1) + 1e-6
    assert sinkhorn(comb, 20, 1e-6) is comb


@pytest.mark.parametrize("c_loop", [True, False])
def test_mixes_rows_alike_in_any_batch(monkeypatch, c_loop: bool) -> None:
    if not c_loop:
        monkeypatch.setattr(native, "sinkhorn", lambda *args: False)
    g = torch.Generator().manual_seed(5)
    h, fn = torch.randn(48, 4, 32, generator=g), torch.randn(24, 128, generator=g) * 0.1
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g) * 0.1
    alone = [invariant_hc_mixes(h[i : i + 1], fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20) for i in range(48)]
    for n in (5, NUMPY_SINKHORN_ROWS, NUMPY_SINKHORN_ROWS + 1, 48):
        together = invariant_hc_mixes(h[:n], fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20)
        for i in range(n):
            assert all(torch.equal(t[i], a[0]) for t, a in zip(together, alone[i], strict=True))
    monkeypatch.setattr(hyper, "NUMPY_SINKHORN_ROWS", 0)  # torch's loop throughout
    for i in (0, 31, 47):
        assert all(torch.equal(t[0], a[0]) for t, a in zip(
            invariant_hc_mixes(h[i : i + 1], fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20), alone[i],
            strict=True))


needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH")


@needs_cc
@pytest.mark.parametrize("rows", [1, 2, 3, 17, NUMPY_SINKHORN_ROWS + 1, 700])
@pytest.mark.parametrize("hc", [1, 2, 3, 4])
def test_c_sinkhorn_is_torch_bit_for_bit(rows: int, hc: int) -> None:
    """For any number of tokens, in place: the C loop ran (the result is the input tensor) and has torch's bits."""
    g = torch.Generator().manual_seed(rows * 10 + hc)
    for _ in range(10):
        comb = torch.softmax(torch.randn(rows, hc, hc, generator=g) * 4, dim=-1) + 1e-6
        expected = torch_sinkhorn(comb, 20, 1e-6)
        assert native.library() is not None, native.reason()
        out = sinkhorn(comb, 20, 1e-6)
        assert out is comb and torch.equal(out, expected)


@needs_cc
def test_c_sinkhorn_leaves_what_it_cannot_take() -> None:
    """hc past MAX_HC (torch adds 5 or more values in another order), views and other dtypes go to torch's loop."""
    wide = torch.softmax(torch.randn(3, native.MAX_HC + 1, native.MAX_HC + 1), dim=-1) + 1e-6
    assert not native.sinkhorn(wide, 20, 1e-6)
    assert torch.equal(sinkhorn(wide.clone(), 20, 1e-6), torch_sinkhorn(wide, 20, 1e-6))
    strided = (torch.softmax(torch.randn(4, 4, 8), dim=-1) + 1e-6)[:, :, :4]
    assert torch.equal(sinkhorn(strided, 20, 1e-6), torch_sinkhorn(strided, 20, 1e-6))
    double = torch.softmax(torch.randn(2, 4, 4, dtype=torch.float64), dim=-1) + 1e-6
    assert torch.equal(sinkhorn(double.clone(), 20, 1e-6), torch_sinkhorn(double, 20, 1e-6))


def test_library_off_or_unbuildable_says_why(monkeypatch, tmp_path) -> None:
    """DEEPINFER_NATIVE=0, a missing compiler and a failing one each leave no library, a reason, and nothing half
    written in the cache."""
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    build = native.library.__wrapped__
    monkeypatch.setenv("DEEPINFER_NATIVE", "0")
    assert build() is None and native.reason() == "DEEPINFER_NATIVE=0"
    monkeypatch.delenv("DEEPINFER_NATIVE")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert build() is None and "no-such-cc" in native.reason() and "not on PATH" in native.reason()
    failing = tmp_path / "failing-cc"
    failing.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo failing-cc 1.0; exit 0; }\n'
                       'echo broken >&2\nexit 1\n')
    failing.chmod(failing.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(failing))
    assert build() is None and "could not compile" in native.reason() and "broken" in native.reason()
    assert list((tmp_path / "native").iterdir()) == []


@needs_cc
def test_library_builds_once_into_the_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    lib = native.library.__wrapped__()
    assert lib is not None, native.reason()
    built = list((tmp_path / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    mtime = built[0].stat().st_mtime_ns
    assert native.library.__wrapped__() is not None
    assert [p.stat().st_mtime_ns for p in (tmp_path / "native").iterdir()] == [mtime]
