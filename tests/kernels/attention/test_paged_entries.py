"""The in-place attention's tile decoders (kernels/attention/paged_entries.py) against `EntryFormat.decode`: every
code of each cache format, under random scales, gives the decoded value rounded to bf16 (which it is exactly), bit
for bit: subnormal codes, zeros and negative zeros included."""

from __future__ import annotations

import pytest
import torch

from dsl.cache_format import EntryFormat
from kernels.attention.paged_entries import decode_tile, load_tile, pool_operands
from kernels.lang import tl, triton
from kernels.launch import launch


@triton.jit
def _decode_rows_kernel(codes_ptr, scales_ptr, rows_ptr, even_ptr, odd_ptr, D: tl.constexpr, KIND: tl.constexpr,
                        BLOCK: tl.constexpr, E4M3: tl.constexpr, block_S: tl.constexpr):
    """Rows rows[i] [block_S] of a pool, decoded: even and odd columns [block_S, D / 2] as bf16 bits."""
    offs = tl.arange(0, block_S)
    rows = tl.load(rows_ptr + offs)
    codes, scales = load_tile(codes_ptr, scales_ptr, rows, rows >= 0, D, KIND, BLOCK)
    even, odd = decode_tile(codes, scales, KIND, BLOCK, E4M3, block_S, D, tl.bfloat16)
    out = offs[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
    tl.store(even_ptr + out, even)
    tl.store(odd_ptr + out, odd)


def random_parts(fmt: EntryFormat, rows: int, d: int, seed: int) -> list[torch.Tensor]:
    """Pool parts [1, rows, ...] of random codes (every finite e4m3 code, every e2m1 pair) and scales: ue8m0 bytes
    100 to 150, or e4m3 scales over their whole positive range, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    parts = fmt.storage((1, rows), d)
    codes, scales = parts
    if fmt.kind == "fp8":
        byte = torch.randint(0, 0x7F, codes.shape, generator=g, dtype=torch.uint8)  # 0x7F / 0xFF are NaN: never stored
        codes.view(torch.uint8).copy_(byte | (torch.rand(codes.shape, generator=g) < 0.5).to(torch.uint8) << 7)
    else:
        codes.copy_(torch.randint(0, 256, codes.shape, generator=g, dtype=torch.uint8))
    if fmt.e4m3_scale:
        scales.view(torch.uint8).copy_(torch.randint(1, 0x7F, scales.shape, generator=g, dtype=torch.uint8))
    else:
        scales.copy_(torch.randint(100, 151, scales.shape, generator=g, dtype=torch.uint8))
    return parts


@pytest.mark.parametrize("fmt", [EntryFormat("fp8", 32), EntryFormat("fp4", 16, True), EntryFormat("fp4", 32)],
                         ids=["window fp8", "kv fp4 e4m3 scales", "fp4 pow2 scales"])
@pytest.mark.parametrize("d", [64, 512])
def test_tiles_decode_exactly(fmt, d, device) -> None:
    rows, block_s = 40, 16
    parts = [p.to(device) for p in random_parts(fmt, rows, d, seed=d)]
    codes, scales, consts = pool_operands(fmt, parts, d, "pool")
    picked = torch.tensor([5, 0, 39, 17, 3, 3, 22, 8, 31, 1, 12, 38, 27, 9, 14, 30], dtype=torch.int32, device=device)
    even = torch.empty(block_s, d // 2, dtype=torch.bfloat16, device=device)
    odd = torch.empty_like(even)
    launch(_decode_rows_kernel, (1,), (codes, scales, picked, even, odd),
           dict(D=d, KIND=consts["KIND"], BLOCK=consts["BLOCK"], E4M3=consts["E4M3"], block_S=block_s), 4, 1)
    want = fmt.decode(*[p[0, picked.long()] for p in parts]).bfloat16()  # [block_S, D], exact
    assert torch.equal(want.float(), fmt.decode(*[p[0, picked.long()] for p in parts]))  # bf16 holds every value
    assert torch.equal(even.view(torch.int16), want[:, 0::2].contiguous().view(torch.int16))
    assert torch.equal(odd.view(torch.int16), want[:, 1::2].contiguous().view(torch.int16))
