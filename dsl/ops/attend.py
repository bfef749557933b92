"""Attention of queries each over keys of their own, with a sink logit per head: what the sparse attention's torch
references run once they have gathered each query's keys (dsl/ops/attention.py, dsl/ops/static_attention.py)."""

from __future__ import annotations

import torch

ATTENTION_ROWS = 512  # queries whose keys are gathered at once: bounded memory


def attend(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries q [T, H, D] each over their own keys [T, S, D] (present where mask [T, S]), the sink logit sink [H] in
    the denominator: fp32 [T, H, D]. The batched form of `sparse_attention`'s per-chunk loop."""
    logits = torch.einsum("thd,tsd->ths", q, keys) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    full = torch.cat([logits, sink.float()[None, :, None].expand(q.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("ths,tsd->thd", probs, keys)


__all__ = ["ATTENTION_ROWS", "attend"]
