"""A sequence's caches as plain fp32 tensors of its own, for running a model without pools (tests, `forward`).

It has `PagedCache`'s methods and keeps every value in the state's `caches` dict, on the device of the values:
the window's last `window - 1` entries, each compressed cache whole, the partial groups and the n-gram history.
Paged and unpaged caches give the same values bit for bit (tests/test_block_manager.py checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dsl.context import SequenceState


class UnpagedCache:
    """Stateless: every method reads or writes `state.caches`. One shared instance serves every state."""

    def read_window(self, state: SequenceState, layer: int, count: int) -> torch.Tensor:
        kept = state.caches[f"window.{layer}"]
        return kept[kept.shape[0] - count:]

    def write_window(self, state: SequenceState, layer: int, values: torch.Tensor, window: int) -> None:
        prev = state.caches.get(f"window.{layer}")
        full = values if prev is None or state.num_tokens == 0 else torch.cat([prev, values])
        state.caches[f"window.{layer}"] = full[max(0, full.shape[0] - (window - 1)):].clone()

    def write_entries(self, state: SequenceState, name: str, layer: int, first: int, values: torch.Tensor) -> None:
        prev = state.caches.get(f"{name}.{layer}")
        kept = prev[:first] if prev is not None else values[:0]
        state.caches[f"{name}.{layer}"] = torch.cat([kept, values.float()])

    def read_entries(self, state: SequenceState, name: str, layer: int, count: int) -> torch.Tensor:
        return state.caches[f"{name}.{layer}"][:count]

    def read_partial(self, state: SequenceState, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, gate = state.caches[f"partial.{layer}"]
        return kv[:count], gate[:count]

    def write_partial(self, state: SequenceState, layer: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        state.caches[f"partial.{layer}"] = (kv.clone(), gate.clone())

    def read_history(self, state: SequenceState) -> torch.Tensor | None:
        return state.caches["engram.history"] if state.num_tokens else None

    def write_history(self, state: SequenceState, ids: torch.Tensor) -> None:
        state.caches["engram.history"] = ids.clone()


UNPAGED = UnpagedCache()
