"""`pow2_ceil` (ue8m0 scale rounding) gives the bits of the formula V41_SPEC.md writes out, exponent - 127 plus one
for a non-zero mantissa, for fp32 bit patterns across the whole range: zero, subnormals, normals, inf and NaN, both
signs."""

from __future__ import annotations

import torch

from dsl.ops.rounding import pow2_ceil


def written_out(t: torch.Tensor) -> torch.Tensor:
    bits = t.contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(k.float())


def test_pow2_ceil_is_the_written_out_formula_bit_for_bit() -> None:
    strided = torch.arange(-(2**31), 2**31, 4099, dtype=torch.int64)  # every exponent, many mantissas
    edges = torch.tensor([0, 1, 0x7FFFFF, 0x800000, 0x800001, 0x7F7FFFFF, 0x7F800000, 0x7F800001, 0x7FC00000,
                          0x7FFFFFFF, -(2**31), -1], dtype=torch.int64)
    t = torch.cat([strided, edges]).to(torch.int32).view(torch.float32)
    assert torch.equal(pow2_ceil(t).view(torch.int32), written_out(t).view(torch.int32))
