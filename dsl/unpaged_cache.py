"""A sequence's caches as plain fp32 tensors of its own, for running a model without pools (tests, `forward`).

It has `PagedCache`'s methods and keeps every value in the state's `caches` dict, on the device of the values,
indexed by position from the sequence start: windows, partial-group rows and n-gram history keep every position
(so any number of a forward's tokens can be taken back), each compressed cache is kept whole.
Paged and unpaged caches give the same values bit for bit (tests/test_block_manager.py checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dsl.context import SequenceState


def _extend(state: SequenceState, key: str, values: torch.Tensor) -> None:
    """Set positions num_tokens .. num_tokens + len(values) - 1 of the per-position cache `key`. Positions before
    them that no forward wrote (a decoder layer's, before `replay_from` in bounded replay) hold zeros: none reads
    them."""
    prev = state.caches.get(key)
    kept = prev[: state.num_tokens] if prev is not None else values[:0]
    gap = values.new_zeros(state.num_tokens - kept.shape[0], *values.shape[1:])
    state.caches[key] = torch.cat([kept, gap, values])


def _before(state: SequenceState, key: str, count: int) -> torch.Tensor:
    """The `count` positions before the state's next token of the per-position cache `key`."""
    return state.caches[key][state.num_tokens - count: state.num_tokens]


class UnpagedCache:
    """Stateless: every method reads or writes `state.caches`. One shared instance serves every state."""

    def read_window(self, state: SequenceState, layer: int, count: int) -> torch.Tensor:
        return _before(state, f"window.{layer}", count)

    def write_window(self, state: SequenceState, layer: int, values: torch.Tensor, window: int) -> None:
        _extend(state, f"window.{layer}", values.float())

    def write_entries(self, state: SequenceState, name: str, layer: int, first: int, values: torch.Tensor) -> None:
        prev = state.caches.get(f"{name}.{layer}")
        kept = prev[:first] if prev is not None else values[:0]
        state.caches[f"{name}.{layer}"] = torch.cat([kept, values.float()])

    def read_entries(self, state: SequenceState, name: str, layer: int, count: int) -> torch.Tensor:
        return state.caches[f"{name}.{layer}"][:count]

    def read_partial(self, state: SequenceState, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _before(state, f"partial_kv.{layer}", count), _before(state, f"partial_gate.{layer}", count)

    def write_partial(self, state: SequenceState, layer: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        _extend(state, f"partial_kv.{layer}", kv)
        _extend(state, f"partial_gate.{layer}", gate)

    def read_history(self, state: SequenceState, count: int) -> torch.Tensor:
        return _before(state, "engram.history", count)

    def write_history(self, state: SequenceState, ids: torch.Tensor) -> None:
        _extend(state, "engram.history", ids)


UNPAGED = UnpagedCache()
