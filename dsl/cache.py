"""The caches a model's forwards keep between steps, laid out in pools shared by many sequences.

Two kinds of storage, sized once from a memory budget by whoever owns the pools:
- per-sequence slots, of a size fixed by the model: every layer's sliding window (a ring of `window` entries,
  position p at row p % window), the compressor's rows of its partial group (a ring of `ratio - 1` rows per KV
  source) and the Engram n-gram history (a ring of the last n - 1 compressed token ids);
- paged blocks for what grows with the sequence: a block covers `block_size` token positions and holds, for every
  compressed cache (KV-source entries, indexer keys), the `block_size / ratio` entries those positions complete.
  One block table per sequence serves every compressed cache.
`CacheSpec.from_graph` reads which caches a model has, their dims and storage formats, off its graph.

Every ring keeps `spare` more positions than the model needs, so a forward's last `spare` tokens can be taken
back (`SequenceState.num_tokens` set lower: rejected drafts): what the kept positions need was not overwritten.
Compressed entries are indexed by position, so entries past the new length are simply written again later.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsl import native
from dsl.cache_format import EntryFormat
from dsl.graph import Graph
from dsl.transfer import to_device

if TYPE_CHECKING:
    from dsl.context import SequenceState


@dataclass(frozen=True)
class CacheSpec:
    """Every cache of a model. `windows`: (layer, dim, window, format); `compressed`: (name, layer, dim, ratio, format);
    `partials`: (layer, dim, ratio) of compressors with ratio > 1; `history`: n - 1 for Engram's n-grams, else 0;
    `spare`: positions every ring keeps beyond that, so the last `spare` tokens of a forward can be taken back."""

    windows: tuple[tuple[int, int, int, EntryFormat], ...] = ()
    compressed: tuple[tuple[str, int, int, int, EntryFormat], ...] = ()
    partials: tuple[tuple[int, int, int], ...] = ()
    history: int = 0
    spare: int = 0

    @classmethod
    def from_graph(cls, graph: Graph, spare: int = 0) -> CacheSpec:
        """The caches of a shape-inferred graph: one per cache op, formats from the rounding op feeding it."""
        ratios = {n.attrs["layer"]: n.attrs["ratio"] for n in graph.nodes if n.op == "compress_pool"}
        windows, compressed, partials, history = [], [], [], 0
        for node in graph.nodes:
            source = node.inputs[0] if node.inputs else None
            if node.op in ("kv_window_append", "kv_window_store", "cache_append"):
                dim = int(source.type.shape[-1])
                producer = source.producer
                op, attrs = (producer.op, producer.attrs) if producer else (None, {})
                fmt = EntryFormat.of_rounding(op, attrs, dim)
                if node.op != "cache_append":
                    windows.append((node.attrs["layer"], dim, node.attrs["window"], fmt))
                else:
                    layer = node.attrs["layer"]
                    compressed.append((node.attrs["name"], layer, dim, ratios[layer], fmt))
            elif node.op == "compress_pool" and node.attrs["ratio"] > 1:
                partials.append((node.attrs["layer"], int(source.type.shape[-1]), node.attrs["ratio"]))
            elif node.op == "engram_ngrams":
                history = node.attrs["n"] - 1
        return cls(tuple(windows), tuple(compressed), tuple(partials), history, spare)

    @property
    def block_multiple(self) -> int:
        """Block sizes must be multiples of this: every compress ratio, so a block holds whole entries."""
        return math.lcm(1, *(ratio for _, _, _, ratio, _ in self.compressed))

    def slot_bytes(self) -> int:
        """Bytes of one sequence's slot: windows, partial groups (kv and gate, fp32) and n-gram history."""
        windows = sum((size + self.spare) * fmt.entry_bytes(dim) for _, dim, size, fmt in self.windows)
        return windows + self.scratch_bytes()

    def scratch_bytes(self) -> int:
        """Bytes of a slot's partial groups and n-gram history: what `PagedCache` holds once more, past the
        sequences' slots, for the rows a static step stores nowhere (`PagedCache.scratch_slot`). A cache layout's
        budget (deepinfer/engine/block_manager.py) covers the slots and blocks; these few bytes come on top."""
        partials = sum(2 * (ratio - 1 + self.spare) * dim * 4 for _, dim, ratio in self.partials)
        return partials + 8 * (self.history + self.spare if self.history else 0)

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of `block_size` token positions across every compressed cache."""
        return sum(block_size // ratio * fmt.entry_bytes(dim) for _, _, dim, ratio, fmt in self.compressed)


def _decode(fmt: EntryFormat, parts: list[torch.Tensor]) -> torch.Tensor:
    """fp32 values [M, D] of M stored entries (none included)."""
    if parts[0].shape[0]:
        return fmt.decode(*parts)
    return torch.zeros(0, parts[0].shape[-1] * (2 if fmt.kind == "fp4" else 1), device=parts[0].device)


def _pool_rows(parts: list[torch.Tensor], major: torch.Tensor, minor: torch.Tensor,
               tables: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    per = parts[0].shape[1]
    return (major if tables is None else tables[major, minor // per]), minor % per


def store_rows(fmt: EntryFormat, parts: list[torch.Tensor], values: torch.Tensor, major: torch.Tensor,
               minor: torch.Tensor, tables: torch.Tensor | None = None, masked: bool = False) -> None:
    """Encode values [M, D] in `fmt` and store row m in every part [*, R, ...] at [block, minor[m] % R]: block
    tables[major[m], minor[m] // R], or major[m] without `tables` (R rows per block or ring). `masked`: rows whose
    major[m] is negative are not stored (a static step's padding rows and the groups it does not complete:
    dsl/step.py); finding them waits for the device here, not in the cache kernel."""
    if masked:
        keep = major >= 0
        values, major, minor = values[keep], major[keep], minor[keep]
    if not values.shape[0]:
        return
    encoded = fmt.encode(values)
    if native.store_rows(parts, encoded, major, minor, tables):  # fp8 / fp4 pools on the CPU, the same bytes in C
        return
    blocks, rows = _pool_rows(parts, major, minor, tables)
    for part, codes in zip(parts, encoded, strict=True):
        part[blocks, rows] = codes


def load_rows(fmt: EntryFormat, parts: list[torch.Tensor], major: torch.Tensor, minor: torch.Tensor,
              tables: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values [M, D] of the rows `store_rows` puts at (major, minor) pairs [M]: fp8 / fp4 pools on the CPU
    gathered and decoded in C (dsl/native.c), as `fmt.decode` decodes them."""
    if fmt.kind != "fp32" and (fast := native.load_rows(parts, major, minor, tables, fmt.kind, fmt.block,
                                                        fmt.e4m3_scale)) is not None:
        return fast
    blocks, rows = _pool_rows(parts, major, minor, tables)
    return _decode(fmt, [p[blocks, rows] for p in parts])


class PagedCache:
    """The pools: `num_slots` sequence slots and `num_blocks` blocks of `block_size` positions (see the module).

    A sequence's `SequenceState` names its slot and block table. The `*_rows` methods read and write entries of any
    number of sequences at once (the batched cache ops); the others one sequence's, through them.
    """

    def __init__(self, spec: CacheSpec, num_slots: int, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu") -> None:
        if block_size % spec.block_multiple:
            raise ValueError(f"block_size {block_size} must be a multiple of every compress ratio "
                             f"(of {spec.block_multiple})")
        self.spec, self.num_slots, self.num_blocks, self.block_size = spec, num_slots, num_blocks, block_size
        self.device = torch.device(device)
        with torch.device(self.device):
            self.windows = {layer: (fmt, fmt.storage((num_slots, size + spec.spare), dim))
                            for layer, dim, size, fmt in spec.windows}
            self.compressed = {(name, layer): (fmt, ratio, fmt.storage((num_blocks, block_size // ratio), dim))
                               for name, layer, dim, ratio, fmt in spec.compressed}
            # one slot more than the sequences': the rows a static step stores nowhere land there (`scratch_slot`)
            self.partials = {layer: torch.empty(2, num_slots + 1, ratio - 1 + spec.spare, dim)
                             for layer, dim, ratio in spec.partials}
            ring = spec.history + spec.spare if spec.history else 0
            self.history = torch.empty(num_slots + 1, ring, dtype=torch.long)
        # How entries go into and out of the pools: the torch functions above, or replacements with their arguments and
        # bitwise results that a target installs for its steps (a GPU target's kernels: graphs/plan_runtime.py).
        self.writer: Callable[..., None] = store_rows
        self.reader: Callable[..., torch.Tensor] = load_rows

    # Rows of the pools, any number at once (the batched cache ops use these directly): ring caches are addressed by
    # (slot, position) pairs, compressed caches by (block table row, entry index). Pairs a write gives twice must
    # bring equal values (a scatter keeps one of them, in no set order).

    def window_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """fp32 entries [M, D] of the window of `layer` at (slot, position) pairs [M]."""
        fmt, parts = self.windows[layer]
        return self.reader(fmt, parts, slots, positions)

    def write_window_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                          masked: bool = False) -> None:
        """Store values [M, D] in the window of `layer` at (slot, position) pairs [M]; `masked`: not where the slot
        is negative."""
        fmt, parts = self.windows[layer]
        self.writer(fmt, parts, values, slots, positions, masked=masked)

    def entry_rows(self, name: str, layer: int, tables: torch.Tensor, run: torch.Tensor,
                   index: torch.Tensor) -> torch.Tensor:
        """fp32 compressed entries [M, D] at entry indices index [M] of the sequences of block tables tables[run]
        (a block holds block_size / ratio entries)."""
        fmt, _, parts = self.compressed[(name, layer)]
        return self.reader(fmt, parts, run, index, tables)

    def write_entry_rows(self, name: str, layer: int, tables: torch.Tensor, run: torch.Tensor, index: torch.Tensor,
                         values: torch.Tensor, masked: bool = False) -> None:
        """Store compressed entries values [M, D] at entry indices index [M] of the sequences of tables[run];
        `masked`: not where run is negative."""
        fmt, _, parts = self.compressed[(name, layer)]
        self.writer(fmt, parts, values, run, index, tables, masked=masked)

    def partial_rows(self, layer: int, slots: torch.Tensor,
                     positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv and gate [M, D] of the compressor of `layer` kept at (slot, position) pairs [M]."""
        pool = self.partials[layer]
        return pool[:, slots, positions % pool.shape[2]].unbind(0)

    def write_partial_rows(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor,
                           gate: torch.Tensor) -> None:
        """Keep kv and gate [M, D] for the compressor of `layer` at (slot, position) pairs [M]."""
        pool = self.partials[layer]
        pool[:, slots, positions % pool.shape[2]] = torch.stack([kv, gate])

    @property
    def scratch_slot(self) -> int:
        """The slot past the sequences' in the compressors' partial rows and the n-gram history: a static step
        (dsl/step.py) stores its padding rows there, since a CUDA graph cannot leave them out without waiting for the
        device."""
        return self.num_slots

    def history_rows(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Compressed token ids [M] at (slot, position) pairs [M]."""
        return self.history[slots, positions % self.history.shape[1]]

    def write_history_rows(self, slots: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """Keep compressed token ids [M] at (slot, position) pairs [M]."""
        self.history[slots, positions % self.history.shape[1]] = ids

    # One sequence's rows, through the above.

    def _span(self, state: SequenceState, count: int, before: bool, ring: int | None = None) -> tuple:
        """(slots, positions) [count] of the `count` positions just before the state's next token, or from it on;
        with `ring`, only the last `ring` of them (the earlier ones share their rows)."""
        first = state.num_tokens - count if before else state.num_tokens
        positions = torch.arange(first, first + count, device=self.device)[-ring if ring else 0:]
        return torch.full_like(positions, state.slot), positions

    def read_window(self, state: SequenceState, layer: int, count: int) -> torch.Tensor:
        """fp32 window entries [count, D] of `layer` at the `count` positions before the state's next token."""
        return self.window_rows(layer, *self._span(state, count, before=True))

    def write_window(self, state: SequenceState, layer: int, values: torch.Tensor, window: int) -> None:
        """Store a chunk's entries values [T, D] (positions from the state's next token on) in the ring, which
        holds the `window` (plus spare) latest positions (the spec sized it so)."""
        slots, positions = self._span(state, values.shape[0], before=False, ring=self.windows[layer][1][0].shape[1])
        self.write_window_rows(layer, slots, positions, values[values.shape[0] - positions.shape[0]:])

    def _table(self, state: SequenceState, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (to_device(state.block_table, self.device).view(1, -1),
                torch.zeros(count, dtype=torch.long, device=self.device))

    def write_entries(self, state: SequenceState, name: str, layer: int, first: int, values: torch.Tensor) -> None:
        """Store compressed entries values [E, D] at entry indices first .. first + E - 1."""
        index = torch.arange(first, first + values.shape[0], device=self.device)
        self.write_entry_rows(name, layer, *self._table(state, values.shape[0]), index, values)

    def read_entries(self, state: SequenceState, name: str, layer: int, count: int) -> torch.Tensor:
        """The first `count` compressed entries, fp32 [count, D]."""
        index = torch.arange(count, device=self.device)
        return self.entry_rows(name, layer, *self._table(state, count), index)

    def read_partial(self, state: SequenceState, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """kv and gate [count, D] of the `count` positions before the state's next token (its partial group)."""
        return self.partial_rows(layer, *self._span(state, count, before=True))

    def write_partial(self, state: SequenceState, layer: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Keep kv and gate [T, D] of a chunk's tokens (positions from the state's next token on); the ring holds
        the latest `ratio - 1` (plus spare)."""
        slots, positions = self._span(state, kv.shape[0], before=False, ring=self.partials[layer].shape[2])
        kept = kv.shape[0] - positions.shape[0]
        self.write_partial_rows(layer, slots, positions, kv[kept:], gate[kept:])

    def read_history(self, state: SequenceState, count: int) -> torch.Tensor:
        """The compressed token ids of the `count` positions before the state's next token."""
        return self.history_rows(*self._span(state, count, before=True))

    def write_history(self, state: SequenceState, ids: torch.Tensor) -> None:
        """Keep the compressed ids [T] of a chunk's tokens (positions from the state's next token on)."""
        slots, positions = self._span(state, ids.shape[0], before=False, ring=self.history.shape[1])
        self.write_history_rows(slots, positions, ids[ids.shape[0] - positions.shape[0]:])

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy slot `src` into slot `dst` bit for bit: every window ring, partial group and the n-gram history (a
        prefix cache's snapshot of a sequence, or its restore). Ring rows are addressed by position alone, so the
        copy holds what `src` held for every position its rings keep."""
        for _, parts in self.windows.values():
            for part in parts:
                part[dst] = part[src]
        for pool in self.partials.values():
            pool[:, dst] = pool[:, src]
        self.history[dst] = self.history[src]

    def nbytes(self) -> int:
        """Bytes the pools hold: the slots, the blocks and the scratch slot's partial groups and history
        (`CacheSpec.scratch_bytes`)."""
        tensors = [t for _, parts in self.windows.values() for t in parts]
        tensors += [t for _, _, parts in self.compressed.values() for t in parts]
        tensors += [*self.partials.values(), self.history]
        return sum(t.element_size() * t.numel() for t in tensors)
