"""A static step's compressed entries (dsl/step.py): what the compressor completes and stores, and the caches the
indexer and the attention read, with every shape set by the step's rows and its block tables' width.

In a forward in general the compressor makes a `Ragged` of the groups its chunks complete, a count that follows the
sequences' lengths. In a static step row t completes the group of `ratio` positions ending at its position p when
(p + 1) % ratio == 0 (every row for ratio 1; never a padding row), so the entries are one row per step row
(`StaticEntries`, rows that complete nothing hold zeros and store nothing), and a compressed cache is read through the
step's block tables, `table_width * entries a block` entries wide (`StaticCompressed`), the entries past a chunk's
own count masked where read. The values each real entry gets are the eager forms' bit for bit: the same groups,
pooled and rounded row by row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsl.ragged import Ragged
from dsl.step import StaticStep


class StaticEntries(Ragged):
    """Compressed entries of a static step: `values` [R, ...], row t the entry step row t completes (zeros where it
    completes none). Row-wise ops map over `values` as over any `Ragged`'s."""

    def __init__(self, values: torch.Tensor, step: StaticStep, ratio: int) -> None:
        super().__init__(values, [], [])
        self.step, self.ratio = step, ratio

    def replace(self, values: torch.Tensor) -> StaticEntries:
        return StaticEntries(values, self.step, self.ratio)


def completes(step: StaticStep, ratio: int) -> torch.Tensor:
    """bool [R]: whether step row t completes a group of `ratio` (a real row at a position p with (p + 1) % ratio
    == 0)."""
    return ((step.positions + 1) % ratio == 0) & (step.write_slots >= 0)


def entry_index(step: StaticStep, ratio: int) -> torch.Tensor:
    """int64 [R]: the index of the entry each row's group makes ((p + 1) // ratio - 1; 0 where it makes none)."""
    return ((step.positions + 1) // ratio - 1).clamp(min=0)


def entry_positions(step: StaticStep, ratio: int) -> torch.Tensor:
    """int64 [R]: where each row's entry is rotated (entry j at j * ratio, as `rope_entries` rotates it)."""
    return entry_index(step, ratio) * ratio


@dataclass
class StaticCompressed:
    """A compressed cache (`name`, `layer`) of ratio `ratio` as a static step reads it after its store: chunk b's
    entries under block table row b of the step's tables, `lengths()[b]` of them, read `width` wide."""

    step: StaticStep
    name: str
    layer: int
    ratio: int

    @property
    def per(self) -> int:
        """Entries a block holds."""
        return self.step.cache.compressed[(self.name, self.layer)][2][0].shape[1]

    @property
    def width(self) -> int:
        """Entries read per chunk: as many as its block table's columns hold."""
        return self.step.width * self.per

    def lengths(self) -> torch.Tensor:
        """int32 [R]: per chunk, the entries its cache holds after the step (zero past the step's chunks)."""
        return self.step.chunk_ends // self.ratio

    def chunk_keys(self) -> torch.Tensor:
        """fp32 [R, width, D]: every chunk's entries, `width` of them (those past its length are whatever the pool
        holds there: readers mask them)."""
        step, width = self.step, self.width
        run = torch.arange(step.rows, device=step.device).repeat_interleave(width)
        index = torch.arange(width, device=step.device).repeat(step.rows)
        keys = step.cache.entry_rows(self.name, self.layer, step.tables, run, index)
        return keys.view(step.rows, width, -1)


def static_append(entries: StaticEntries, *, layer: int, name: str, step: StaticStep) -> StaticCompressed:
    """`cache_append` over a static step: store the entries its rows complete, at their entry indices under their
    chunks' block tables (the others nowhere); a view of the whole cache."""
    ratio = entries.ratio
    run = torch.where(completes(step, ratio), step.row_chunks.long(), -1)
    step.cache.write_entry_rows(name, layer, step.tables, run, entry_index(step, ratio), entries.values, masked=True)
    return StaticCompressed(step, name, layer, ratio)


def visible_counts(keys: StaticCompressed, step: StaticStep) -> torch.Tensor:
    """int64 [R]: the entries each row sees: those complete at its position ((p + 1) // ratio), within its chunk's."""
    length = keys.lengths()[step.row_chunks.long()].long()
    return torch.minimum((step.positions + 1) // keys.ratio, length)


__all__ = ["StaticCompressed", "StaticEntries", "completes", "entry_index", "entry_positions", "static_append",
           "visible_counts"]
