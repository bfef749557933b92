"""The token bitmask: one bit per vocabulary id (1 = allowed), 32 ids per int32 word, and applying it to logits.

Applying sets the logits of disallowed ids to -inf in place. On CUDA, xgrammar's Triton kernel does it in one
launch. On the CPU, `apply_bitmask_torch` does: unpacking the whole row and one masked_fill cost the same whatever the
mask, where xgrammar's CPU loop writes each disallowed id alone, slowest for the usual mask that allows a few ids
(bench/structured_outputs_bench.py and bench/RESULTS.md), and corrupts the heap below 16 ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import xgrammar as xgr

from deepinfer.sampler import unpack_bitmask  # noqa: F401  (part of this module's interface)


def bitmask_width(vocab_size: int) -> int:
    """Words per bitmask row: ceil(vocab_size / 32)."""
    return math.ceil(vocab_size / 32)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask int32 [num_rows, ceil(vocab_size / 32)] on the CPU (pinned when CUDA is present, so
    its copy to the device can overlap)."""
    bitmask = torch.empty((num_rows, bitmask_width(vocab_size)), dtype=torch.int32,
                          pin_memory=torch.cuda.is_available())
    allow_all(bitmask, range(num_rows))
    return bitmask


def allow_all(bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Set `rows` of a CPU bitmask to all-allowed, in place, through numpy rather than torch.

    Masks are filled on a thread of their own while the forward runs. A torch op large enough to go parallel there
    (32768 elements: 9 rows at the V4 vocabulary) starts a second OpenMP team; with more OpenMP threads than cores,
    libgomp stops spinning between parallel regions for the whole process, and every later op of the cpu target
    waits for its worker to wake (slower steps: bench/RESULTS.md, 2026-11-30). numpy has no thread team.
    """
    bitmask.numpy()[list(rows)] = -1


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """logits[r, v] = -inf where bit v of bitmask[r] is 0, for r in `rows` (default: every row). In place.

    logits: [B, V] any float dtype, any device; bitmask: int32 [>= B, ceil(V / 32)] (CPU is fine: it is copied).
    Rows index both tensors alike, so the bitmask may be a preallocated buffer larger than the batch.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"need logits [B, V] and an int32 bitmask [B, W], got {tuple(logits.shape)} and "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[1] != bitmask_width(logits.shape[1]):
        # a narrower mask would leave the logits past its end unmasked: the head and the mask disagree on the vocab
        raise ValueError(f"a bitmask of {bitmask.shape[1]} words per row does not cover a vocabulary of "
                         f"{logits.shape[1]} (needs {bitmask_width(logits.shape[1])})")
    rows = list(range(logits.shape[0])) if rows is None else list(rows)
    if not rows:
        return
    if max(rows) >= min(logits.shape[0], bitmask.shape[0]) or min(rows) < 0:
        raise ValueError(f"rows {rows} out of range for {logits.shape[0]} logit rows, {bitmask.shape[0]} mask rows")
    if logits.device.type != "cuda":
        apply_bitmask_torch(logits, bitmask, rows)
        return
    bitmask = bitmask.to(logits.device, non_blocking=True)
    all_rows = len(rows) == logits.shape[0] == bitmask.shape[0]
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=None if all_rows else rows)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """`apply_bitmask` in torch, for any dtype and device: the path off CUDA, and the reference for xgrammar's."""
    rows = list(rows)
    bitmask = bitmask.to(logits.device)
    # the model's forward returns inference tensors, which only inference mode may update in place
    with torch.inference_mode(logits.is_inference()):
        if rows == list(range(logits.shape[0])):
            logits.masked_fill_(~unpack_bitmask(bitmask[: len(rows)], logits.shape[1]), float("-inf"))
            return
        index = torch.as_tensor(rows, dtype=torch.long, device=logits.device)
        allowed = unpack_bitmask(bitmask[index], logits.shape[1])  # [len(rows), V]
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
