"""The compressor of a KV-source layer: pools `ratio` consecutive tokens into one entry.

Partial groups wait in the sequence's cache across forwards; a group becomes an entry once complete. A sequence
of p tokens has completed p // ratio entries and its cache holds (at least) the p % ratio rows of its partial group:
every token's rows are written, so a sequence taken back to fewer tokens still finds its group's rows.
"""

from __future__ import annotations

import torch

from dsl.ops.registry import op
from dsl.ragged import Ragged
from dsl.tensor import TensorType, num_entries


def _entries_type(kv: TensorType, *rest, **attrs) -> tuple[TensorType]:
    return (TensorType((num_entries, kv.shape[-1]), "entries"),)


@op("compress_pool", _entries_type, uses_context=True)
def compress_pool(kv: torch.Tensor, gate: torch.Tensor | None = None, *, layer: int, ratio: int, ctx) -> Ragged:
    """Pool kv [N, D] in groups of `ratio` tokens, weighted by the softmax over the group of gate [N, D].

    Ratio 1 passes every token through (no gate). Returns the completed entries (fp32, pre-norm and pre-rope)
    of each sequence, with their absolute entry indices.
    """
    values, counts, first = [], [], []
    for c in ctx.chunks:
        storage, done, pending = c.state.storage, c.start_pos // ratio, c.start_pos % ratio
        ckv = kv[c.rows].float()
        if ratio == 1:
            pooled = ckv
        else:
            cgate = gate[c.rows].float()
            if pending:
                kept_kv, kept_gate = storage.read_partial(c.state, layer, pending)
            storage.write_partial(c.state, layer, ckv, cgate)
            if pending:
                ckv, cgate = torch.cat([kept_kv.to(ckv.device), ckv]), torch.cat([kept_gate.to(ckv.device), cgate])
            usable = ckv.shape[0] // ratio * ratio
            groups = ckv[:usable].reshape(-1, ratio, ckv.shape[-1])
            weights = cgate[:usable].reshape(-1, ratio, ckv.shape[-1]).softmax(dim=1)
            pooled = (groups * weights).sum(dim=1)
        values.append(pooled)
        counts.append(pooled.shape[0])
        first.append(done)
    flat = torch.cat(values) if values else kv.new_zeros(0, kv.shape[-1], dtype=torch.float32)
    return Ragged(flat, counts, first)
