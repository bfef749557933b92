"""Engram's lowerings: its gate onto the streams (gate.py) and its fused n-gram hash and table gather
(hash_rows.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels.engram.gate as gate
import kernels.engram.hash_rows as hash_rows
from dsl.graph import Node
from dsl.tensor import num_tokens
from kernels.lowering import PLAIN, Call, Lowering, Params, Static, Variant, meta, param, token_planes


@dataclass(frozen=True)
class GateStatic(Static):
    """Streams [N, hc, d]."""

    hc: int
    d: int


@dataclass(frozen=True)
class HashRowsStatic(Static):
    """The table's dtype as it is stored (no copy of a table of hundreds of millions of rows), fp8 with its scales
    (`scaled`: a float scale, made fp32 once) or without (its codes, as the reference)."""

    n: int  # tokens an n-gram
    rows: int
    d: int
    dtype: str  # the table's torch dtype, e.g. "float8_e4m3fn"
    scaled: bool


class EngramGate(Lowering):
    template, ops, static_type, sources = "engram_gate", ("engram_gate",), GateStatic, (gate,)

    def static(self, node: Node, params: Params) -> GateStatic | None:
        planes, kv = token_planes(node.inputs[0].type), node.inputs[1].type
        if planes is None or node.inputs[0].type.dtype != "float32" or kv is None or kv.dtype != "float32":
            return None
        return GateStatic(*planes)

    def formats(self, static: GateStatic) -> dict[int, str]:
        return {2: "fp32", 3: "fp32"}

    def default_config(self, static: GateStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return {}

    def run(self, call: Call) -> torch.Tensor:
        h, kv, q, k = call.args
        return gate.engram_gate(h.contiguous(), kv.contiguous(), q, k, eps=call.attrs["eps"])

    def trace(self, call: Call) -> None:
        hc, d, m = call.static.hc, call.static.d, call.tokens
        gate.engram_gate(meta(m, hc, d), meta(m, (hc + 1) * d), meta(hc, d), meta(hc, d), eps=call.attrs["eps"])


class EngramHashRows(Lowering):
    template, ops, static_type, sources = "engram_hash_rows", ("engram_hash_rows",), HashRowsStatic, (hash_rows,)

    def static(self, node: Node, params: Params) -> HashRowsStatic | None:
        ngrams, table, scale = node.inputs[0].type, param(node, 1, params), param(node, 2, params)
        if ngrams.dtype != "int64" or ngrams.rank != 2 or ngrams.shape[0] != num_tokens or table is None \
                or table.dim() != 2 or table.dtype not in hash_rows.TABLE_DTYPES:
            return None
        rows, d = table.shape
        scaled = table.dtype == torch.float8_e4m3fn and node.inputs[2] is not None
        if scaled and (scale is None or not scale.is_floating_point() or tuple(scale.shape) != (rows, -(-d // 32))):
            return None
        return HashRowsStatic(int(ngrams.shape[1]), rows, d, str(table.dtype).removeprefix("torch."), scaled)

    def formats(self, static: HashRowsStatic) -> dict[int, str]:
        return {1: "raw", 2: "fp32"} if static.scaled else {1: "raw"}

    def default_config(self, static: HashRowsStatic, tokens: int, variant: Variant = PLAIN,
                       gemms: tuple[str, ...] = ()) -> dict:
        return hash_rows.default_config(tokens, static.d)

    def run(self, call: Call) -> torch.Tensor:
        ngrams, table, scale = call.args
        return self._rows(call, ngrams.contiguous(), table, scale)

    def trace(self, call: Call) -> None:
        st = call.static
        table = meta(st.rows, st.d, dtype=getattr(torch, st.dtype))
        self._rows(call, meta(call.tokens, st.n, dtype=torch.int64), table, meta(st.rows, -(-st.d // 32)))

    @staticmethod
    def _rows(call: Call, ngrams, table, scale) -> torch.Tensor:
        return hash_rows.engram_hash_rows(ngrams, table, scale if call.static.scaled else None, **call.attrs,
                                          config=call.config)


ENGRAM_GATE, ENGRAM_HASH_ROWS = EngramGate(), EngramHashRows()
LOWERINGS = (ENGRAM_GATE, ENGRAM_HASH_ROWS)

__all__ = ["ENGRAM_GATE", "ENGRAM_HASH_ROWS", "LOWERINGS", "GateStatic", "HashRowsStatic"]
