"""How a cache stores its entries: plain fp32, or the fp8 / fp4 codes the model rounded them to, with block scales.

The values reaching a cache already lie on a format's grid (the graph rounds them with `fp8_round` or `fp4_round`
first), so storing codes and scales loses nothing: `decode(*encode(x))` is `x` bit for bit. The formats are those
of V41_SPEC.md: the window in e4m3 with power-of-two (ue8m0) scales per 32 values, the compressed KV in e2m1 with
e4m3 scales per 16, the indexer keys in e2m1 with power-of-two scales per 32. fp4 codes are packed two per byte,
the even column in the low nibble.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dsl import native
from dsl.ops.rounding import ENDS_WITH, FP4_MAX, FP8_MAX, _fp32, fp4_codes, fp4_values, pow2_ceil
from dsl.quant import scale_to_float

# The largest |code| an fp4 block can hold, largest first: an e4m3-scaled block's scale is its amax over one of them.
_FP4_MAXIMA = (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5)


@functools.cache
def _e8m0_values(device: torch.device) -> torch.Tensor:
    """fp32 values [256] of the ue8m0 scale bytes (`scale_to_float` of each), per device: decoding a scale is then one
    lookup."""
    return scale_to_float(torch.arange(256, dtype=torch.uint8).view(torch.float8_e8m0fnu)).to(device)


@dataclass(frozen=True)
class EntryFormat:
    """`kind` "fp32", "fp8" or "fp4"; `block` values share a scale; fp4 scales are e4m3 when `e4m3_scale`, else
    powers of two (as are fp8 scales)."""

    kind: str = "fp32"
    block: int = 0
    e4m3_scale: bool = False

    @classmethod
    def of_rounding(cls, op: str | None, attrs: dict, dim: int) -> EntryFormat:
        """The format of values produced by rounding op `op` (None: not rounded; a rope fused with its rounding:
        `ENDS_WITH`) over a last dim of `dim`."""
        op = ENDS_WITH.get(op, op)
        block = attrs.get("block", 32)
        if op == "fp8_round" and dim % block == 0:
            return cls("fp8", block)
        if op == "fp4_round" and dim % block == 0 and dim % 2 == 0:
            return cls("fp4", block, bool(attrs["e4m3_scale"]))
        return cls()  # rounding is skipped when the dim is not a multiple of the block: the values are plain

    def storage(self, prefix: tuple[int, ...], dim: int) -> list[torch.Tensor]:
        """Tensors for entries of `dim` values at every index of `prefix`: codes, then scales. Uninitialised: a
        cache reads only what it wrote, and untouched memory stays unmapped on the CPU."""
        if self.kind == "fp32":
            return [torch.empty(*prefix, dim, dtype=torch.float32)]
        scales = torch.empty(*prefix, dim // self.block, dtype=self._scale_dtype)
        if self.kind == "fp8":
            return [torch.empty(*prefix, dim, dtype=torch.float8_e4m3fn), scales]
        return [torch.empty(*prefix, dim // 2, dtype=torch.uint8), scales]

    def entry_bytes(self, dim: int) -> int:
        """Bytes one entry of `dim` values takes."""
        return sum(t.element_size() * t.numel() for t in self.storage((1,), dim))

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Codes and scales of fp32 values x [..., D] that lie on this format's grid (the rounding ops put them
        there). fp32 on the CPU runs the same arithmetic in C (dsl/native.c)."""
        if self.kind == "fp32":
            return [_fp32(x)]
        if (fast := native.encode(x, self.kind, self.block, self.e4m3_scale)) is not None:
            return fast
        blocks = _fp32(x).reshape(*x.shape[:-1], -1, self.block)  # [..., D / block, block]
        amax = blocks.abs().amax(-1, keepdim=True)
        if self.kind == "fp8":
            # x = q * s with s a power of two; any power of two >= amax / 448 represents x exactly: e4m3 is closed
            # under doubling below 448.
            scale = pow2_ceil(amax / FP8_MAX)
            codes = (blocks / scale).to(torch.float8_e4m3fn).reshape(x.shape)
            return [codes, self._store_scale(scale.squeeze(-1))]
        scale = self._fp4_scale(blocks, amax)
        codes = fp4_codes(blocks / scale).reshape(x.shape)
        return [codes[..., 0::2] | (codes[..., 1::2] << 4), self._store_scale(scale.squeeze(-1))]

    def decode(self, *parts: torch.Tensor) -> torch.Tensor:
        """fp32 values [..., D] of stored codes and scales (in C on the CPU, dsl/native.c)."""
        if self.kind == "fp32":
            return parts[0]
        codes, scales = parts
        if (fast := native.decode(codes, scales, self.kind, self.block, self.e4m3_scale)) is not None:
            return fast
        scale = scales.float() if self.e4m3_scale else _e8m0_values(scales.device)[scales.long()]
        if self.kind == "fp8":
            values = codes.float()
        else:
            values = fp4_values(torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2))
        blocks = values.reshape(*values.shape[:-1], -1, self.block) * scale.unsqueeze(-1)
        return blocks.reshape(values.shape)

    @property
    def _scale_dtype(self) -> torch.dtype:
        # ue8m0 bytes are kept as uint8: torch cannot index_put float8_e8m0fnu tensors.
        return torch.float8_e4m3fn if self.e4m3_scale else torch.uint8

    def _store_scale(self, scale: torch.Tensor) -> torch.Tensor:
        if self.e4m3_scale:
            return scale.to(torch.float8_e4m3fn)
        return scale.to(torch.float8_e8m0fnu).view(torch.uint8)

    def _fp4_scale(self, blocks: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        """A scale per block [..., B, 1] under which every value of `blocks` [..., B, block] is an e2m1 code."""
        if not self.e4m3_scale:
            return pow2_ceil(amax / FP4_MAX)  # e2m1 is closed under doubling below 6, as e4m3 below 448
        # An e4m3 scale is amax over the block's largest |code|, which is not always 6 (small blocks round it
        # down): the first candidate that is an e4m3 value and reproduces the block exactly, all tried at once.
        tops = torch.tensor(_FP4_MAXIMA, device=amax.device).view(-1, *[1] * amax.dim())
        scale = amax / tops  # [candidates, ..., B, 1]
        scale_e = scale.to(torch.float8_e4m3fn).float()
        exact = (fp4_values(fp4_codes((blocks / scale_e).clamp(-FP4_MAX, FP4_MAX))) * scale_e == blocks)
        ok = (scale_e == scale) & exact.all(-1, keepdim=True)
        zero = amax == 0
        if not bool((ok.any(0) | zero).all()):
            raise ValueError("a cache entry is not on the fp4 grid with an e4m3 scale: round it with fp4_round first")
        first = ok.to(torch.uint8).argmax(0, keepdim=True)  # the first candidate that holds
        return torch.where(zero, 1.0, scale_e.gather(0, first).squeeze(0))
