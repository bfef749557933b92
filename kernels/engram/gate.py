"""Engram's gate: each hyper-connection stream gains a gated copy of the Engram value.

`engram_gate(h, kv, q_weight, k_weight)` is `dsl.ops.engram.engram_gate` in one pass: one program per (token,
stream) loads the stream, its key and the shared value (D values each, in registers), reduces the stream's and the
key's sums of squares and their weighted dot product with `tl.sum`, and writes h + gate * value. Memory-bound:
(2 * hc + 1) * D fp32 reads (the value once per stream, from L2 after the first) and hc * D writes a token.

Why a kernel rather than torch: besides the launches it saves, torch's CUDA reductions split a row's sum by how many
rows the tensor has, so a token's gate changed in its last bits with the batch and with the rows a CUDA-graph
step pads to its bucket; after a few layers such a bit can flip a top-k pick. Here a row's reduction order depends
only on D and the fixed launch (block_D, warps): the same bits for any N, padded or not, invariant or not.
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit
def engram_gate_kernel(h_ptr, kv_ptr, q_ptr, k_ptr, out_ptr, HC: tl.constexpr, D: tl.constexpr, EPS: tl.constexpr,
                       block_D: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    offs = tl.arange(0, block_D)
    mask = offs < D
    h = tl.load(h_ptr + (row * HC + s) * D + offs, mask=mask, other=0.0)
    key = tl.load(kv_ptr + row * (HC + 1) * D + s * D + offs, mask=mask, other=0.0)
    value = tl.load(kv_ptr + row * (HC + 1) * D + HC * D + offs, mask=mask, other=0.0)
    w = tl.load(q_ptr + s * D + offs, mask=mask, other=0.0) * tl.load(k_ptr + s * D + offs, mask=mask, other=0.0)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / D + EPS) * tl.rsqrt(tl.sum(key * key, axis=0) / D + EPS)
    dot = tl.sum(h * w * key, axis=0) * rstd * (1.0 / tl.sqrt(D * 1.0))
    root = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    gate = tl.sigmoid(tl.where(dot < 0, -root, root))
    tl.store(out_ptr + (row * HC + s) * D + offs, h + gate * value, mask=mask)


def engram_gate(h: torch.Tensor, kv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, *,
                eps: float) -> torch.Tensor:
    """h [N, hc, D] fp32 streams, kv [N, (hc + 1) * D] fp32 (a key per stream, then the value), q_weight and
    k_weight [hc, D] fp32: returns fp32 [N, hc, D], h + gate * value a stream."""
    if h.dim() != 3 or h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"engram_gate needs contiguous float32 streams [N, hc, D], got {h.dtype} {list(h.shape)}")
    n, hc, d = h.shape
    for name, t, shape in (("kv", kv, (n, (hc + 1) * d)), ("q_weight", q_weight, (hc, d)),
                           ("k_weight", k_weight, (hc, d))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"engram_gate's {name} must be contiguous float32 {list(shape)}, got {t.dtype} "
                             f"{list(t.shape)}")
    out = torch.empty_like(h)
    if n == 0:
        return out
    block_d = triton.next_power_of_2(d)
    launch(engram_gate_kernel, (n, hc), (h, kv, q_weight, k_weight, out), dict(HC=hc, D=d, EPS=eps, block_D=block_d),
           4 if block_d <= 2048 else 8, 1)
    return out


__all__ = ["engram_gate"]
