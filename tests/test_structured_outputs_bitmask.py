"""Applying the token bitmask: xgrammar's kernel against the torch reference, bitwise, and its shape checks."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from deepinfer.structured_outputs.bitmask import (
    allocate_bitmask,
    apply_bitmask,
    apply_bitmask_torch,
    bitmask_width,
    unpack_bitmask,
)

VOCABS = [1, 31, 32, 33, 1000, 129280]  # the real V4.1 vocabulary, and sizes that do and do not fill the last word


def _random_bitmask(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    # int32 words with every bit pattern, sign bit included
    return torch.randint(-(2**31), 2**31, (rows, bitmask_width(vocab)), dtype=torch.int64, generator=gen).to(
        torch.int32)


def test_unpack_matches_bit_arithmetic() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = _random_bitmask(3, 70, gen)  # [3, 3]
    allowed = unpack_bitmask(bitmask, 70)  # [3, 70]
    for r in range(3):
        for v in range(70):
            word = int(bitmask[r, v // 32]) & 0xFFFFFFFF
            assert bool(allowed[r, v]) == bool(word >> (v % 32) & 1)


def test_allocated_bitmask_allows_everything() -> None:
    bitmask = allocate_bitmask(4, 129280)  # [4, 4040]
    assert bitmask.shape == (4, 4040) and bitmask.dtype == torch.int32
    assert unpack_bitmask(bitmask, 129280).all()


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [None, [0, 2], [3]])
def test_apply_masks_exactly_the_cleared_bits(vocab: int, dtype: torch.dtype, rows: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=gen).to(dtype)  # [4, V]
    bitmask = _random_bitmask(6, vocab, gen)  # [6, W]: a buffer larger than the batch, as the manager's
    got = logits.clone()
    apply_bitmask(got, bitmask, rows)
    allowed = unpack_bitmask(bitmask[:4], vocab)  # [4, V]
    masked = rows if rows is not None else [0, 1, 2, 3]
    for r in range(4):
        if r in masked:
            assert torch.equal(got[r].isneginf(), ~allowed[r])
            assert torch.equal(got[r][allowed[r]], logits[r][allowed[r]])
        else:
            assert torch.equal(got[r], logits[r])  # unconstrained rows are left as they were


@pytest.mark.parametrize("vocab", [v for v in VOCABS if v >= 32])  # its CPU loop corrupts the heap below 16 ids
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [None, [0, 2]])
def test_xgrammars_cpu_kernel_agrees_bitwise(vocab: int, dtype: torch.dtype, rows: list[int] | None) -> None:
    gen = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(4, vocab, generator=gen).to(dtype)
    bitmask = _random_bitmask(4, vocab, gen)
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, bitmask, rows)
    xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab, indices=rows)
    assert torch.equal(ours, theirs)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_uses_xgrammars_kernel_and_agrees(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 129280, generator=gen).to(dtype)
    bitmask = _random_bitmask(8, 129280, gen)  # CPU, pinned or not: copied by apply_bitmask
    expected = logits.clone()
    apply_bitmask_torch(expected, bitmask, [0, 3, 4])
    got = logits.cuda()
    apply_bitmask(got, bitmask, [0, 3, 4])
    assert torch.equal(got.cpu(), expected)


def test_apply_on_a_non_contiguous_view() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 200, generator=gen)[:, :100]  # rows of a wider tensor: stride 200
    bitmask = _random_bitmask(3, 100, gen)
    expected = logits.masked_fill(~unpack_bitmask(bitmask, 100), float("-inf"))
    apply_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)


def test_apply_updates_inference_tensors() -> None:
    with torch.inference_mode():
        logits = torch.randn(2, 64)  # as the model's forward returns them
    apply_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), rows=[1])
    assert logits[1].isneginf().all() and logits[0].isfinite().all()


def test_empty_rows_is_a_no_op() -> None:
    logits = torch.randn(2, 64)
    before = logits.clone()
    apply_bitmask(logits, torch.zeros(2, 2, dtype=torch.int32), rows=[])
    assert torch.equal(logits, before)


@pytest.mark.parametrize("logits_shape,bitmask_shape,dtype,rows,message", [
    ((2, 100), (2, 3), torch.int32, None, "does not cover a vocabulary of 100"),  # a head wider than the mask
    ((2, 64), (2, 3), torch.int32, None, "does not cover a vocabulary of 64"),
    ((2, 64), (2, 2), torch.int64, None, "int32 bitmask"),
    ((64,), (1, 2), torch.int32, None, "need logits \\[B, V\\]"),
    ((2, 64), (2, 2), torch.int32, [2], "out of range"),
    ((3, 64), (2, 2), torch.int32, [2], "out of range"),
])
def test_bad_shapes_raise(logits_shape: tuple, bitmask_shape: tuple, dtype: torch.dtype, rows: list[int] | None,
                          message: str) -> None:
    with pytest.raises(ValueError, match=message):
        apply_bitmask(torch.randn(logits_shape), torch.zeros(bitmask_shape, dtype=dtype), rows)
