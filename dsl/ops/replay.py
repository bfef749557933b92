"""Bounded replay's boundary: from it on, the decoder layers run over each prefill's last tokens only.

Before `decoder_context`, `replay_rows` takes each per-token value the decoder layers read to the rows they run over
(`ForwardContext.replay_rows`); `decoder_context` then gives the context those rows make (`decoder_view`), which
every later node runs in. Where a forward drops no row and no window is cut, both are the identity.
"""

from __future__ import annotations

import torch

from dsl.context import ForwardContext
from dsl.ops.registry import op, same_as_first


@op("replay_rows", same_as_first, uses_context=True)
def replay_rows(x: torch.Tensor, *, window: int, ctx: ForwardContext) -> torch.Tensor:
    """The rows of x [N, ...] the decoder layers run over, in order: [M, ...] (x itself where that is every row)."""
    rows = ctx.replay_rows(window)
    return x if rows is None else x[rows]


@op("decoder_context", lambda **attrs: (), num_outputs=0, uses_context=True, sets_context=True)
def decoder_context(*, window: int, ctx: ForwardContext) -> ForwardContext:
    """The context of the rows `replay_rows` keeps, whose windows of up to `window` see no position before their
    sequence's `replay_from`."""
    return ctx.decoder_view(window)
