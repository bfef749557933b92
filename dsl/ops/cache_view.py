"""A cache as attention and the indexer read it after a forward's writes (`CacheView`), and where a paged cache's
entries lie: a compressed cache's in its pool's blocks (`PagedEntries`), a window's in its ring (`PagedWindow`), with
a copy of the window views a forward's own store overwrites (`WindowSnapshot`).

The cache ops (dsl/ops/attention.py) make the views; the attention (its reference there, the kernels in
kernels/attention/) and the indexer (dsl/ops/indexer.py, kernels/indexer/) read them, as flat keys or, where a view
names its pools, in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dsl.context import ForwardContext, segments
from dsl.transfer import to_device

if TYPE_CHECKING:
    from dsl.cache import PagedCache


@dataclass
class PagedEntries:
    """Where a compressed cache's entries lie: cache (`name`, `layer`) of `cache`, chunk i's under block table row i
    of `tables` [B, W], in the forward of `ctx`."""

    cache: PagedCache
    name: str
    layer: int
    tables: torch.Tensor
    ctx: ForwardContext

    def rows(self, run: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """fp32 entries [M, D]: entry index[m] of chunk run[m]."""
        return self.cache.entry_rows(self.name, self.layer, self.tables, run, index)


@dataclass
class PagedWindow:
    """Where a window view's entries lie: the ring of `layer` in `cache` (a window of `window`), chunk i's in slot
    `slots[i]`, in the forward of `ctx`."""

    cache: PagedCache
    layer: int
    window: int
    slots: torch.Tensor
    ctx: ForwardContext

    def intact_chunks(self) -> list[bool]:
        """Per chunk: whether its ring, after this forward's store, still holds every position its view shows. A
        chunk of T tokens overwrites the rows of the positions RING - T + 1 and more before its last, and the view
        reaches `window - 1` before its first, so T <= RING - window + 1 (decode and verification chunks: the rings
        keep that many spare positions). Each chunk writes its own slot only."""
        ring = self.cache.windows[self.layer][1][0].shape[1]
        return [n <= ring - self.window + 1 for n in self.ctx.lengths]

    def intact(self) -> bool:
        """Whether every chunk's ring still holds its view (`intact_chunks`)."""
        return all(self.intact_chunks())

    def snapshot(self, kv: torch.Tensor, first: list[int]) -> WindowSnapshot:
        """Before this forward's store: the views of the chunks that are not intact, in a ring of their own (see
        `WindowSnapshot`); `first` [B] the first position each chunk's view shows, kv [N, D] the forward's keys."""
        ctx, cache = self.ctx, self.cache
        fmt, parts = cache.windows[self.layer]
        ring = parts[0].shape[1]
        far = [i for i, ok in enumerate(self.intact_chunks()) if not ok]
        span = max(ctx.starts[i] + ctx.lengths[i] - first[i] for i in far)  # rows: every far chunk's whole view
        snap = [p.new_empty(len(far), span, *p.shape[2:]) for p in parts]
        slots = [0] * len(ctx.chunks)
        src, dst, rows, minor, major = [], [], [], [], []
        for j, i in enumerate(far):
            slots[i] = j
            c = ctx.chunks[i]
            for p in range(first[i], c.start_pos):  # the kept positions, as the ring holds them now
                src.append(c.state.slot * ring + p % ring)
                dst.append(j * span + p % span)
            rows += range(c.start, c.start + c.length)
            minor += range(c.start_pos, c.start_pos + c.length)
            major += [j] * c.length
        if src:  # now, before the store overwrites them
            src_t, dst_t = to_device(src, kv.device), to_device(dst, kv.device)
            for s, p in zip(snap, parts, strict=True):
                s.view(-1, *s.shape[2:])[dst_t] = p.view(-1, *p.shape[2:])[src_t]

        def own_keys() -> None:  # the chunks' own keys, encoded as the store encodes them, when first read
            cache.writer(fmt, snap, kv[to_device(rows, kv.device)], to_device(major, kv.device),
                         to_device(minor, kv.device))
        return WindowSnapshot(fmt, snap, to_device(slots, kv.device), own_keys)


class WindowSnapshot:
    """The window views of a forward's chunks that its own store overwrites (a prefill chunk longer than the rings'
    spare positions: not `PagedWindow.intact`), copied out before the store into a ring of their own: position p of
    chunk b at row p % R of slot `slots[b]` of `parts` [far chunks, R, ...] in the window's format `fmt` (R: the
    longest such view). The rows the ring held are copied as stored and the chunk's keys encoded by the pools' writer
    (when `parts` is first read: an attention that gathers never asks), so an attention that reads it in place reads
    the values it would read from the ring: a token's attention does not follow how its prompt was chunked."""

    def __init__(self, fmt, parts: list[torch.Tensor], slots: torch.Tensor, fill: Callable[[], None]) -> None:
        self.fmt, self._parts, self._fill = fmt, parts, fill
        self.slots = slots  # [B]: each far chunk's slot in `parts` (0 for the others, which the ring serves)

    @property
    def parts(self) -> list[torch.Tensor]:
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill()
        return self._parts


class CacheView:
    """A cache after this forward's writes, as attention and the indexer read it: per chunk i, L_i keys [L_i, D] and,
    for windows, their positions, consecutive from first[i].

    Three forms: per-chunk lists (`CacheView(keys, positions)`); flat, chunk after chunk (`values` [sum L_i, D], as
    the batched window ops make it); or, for a paged compressed cache, only where the entries lie (`paged`), read and
    decoded when asked for: `rows` then reads only the entries wanted. `keys`, `positions`, `flat` and `rows` serve
    every form. `length`, `offset` and `first_t` [B] are device copies of `lengths`, of where each chunk's keys begin
    in `flat()` and of `first`, when the maker has them. A paged window's view names its ring (`ring`) and makes its
    values when first read (`make`), so an attention that reads the ring in place gathers nothing; a draft block's
    names the chunks' own keys too (`block`, [N, D]: each chunk's last L_i - kept entries); an appended window's,
    the views its store overwrote (`snapshot`).
    """

    def __init__(self, keys: list[torch.Tensor] | None = None, positions: list[torch.Tensor] | None = None, *,
                 values: torch.Tensor | None = None, lengths: list[int] | None = None, first: list[int] | None = None,
                 length: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                 first_t: torch.Tensor | None = None, paged: PagedEntries | None = None,
                 ring: PagedWindow | None = None, make: Callable[[], torch.Tensor] | None = None) -> None:
        self._keys, self._positions, self._values, self.paged = keys, positions, values, paged
        self.ring, self._make = ring, make
        self.block: torch.Tensor | None = None
        self.snapshot: WindowSnapshot | None = None
        self.lengths = lengths if lengths is not None else [k.shape[0] for k in keys]
        if first is None and positions is not None:
            first = [int(p[0]) if p.numel() else 0 for p in positions]
        self.first, self.length, self.first_t = first, length, first_t
        self._offset = offset

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per chunk: keys [L_i, D]."""
        if self._keys is None:
            self._keys = list(self.flat().split(self.lengths))
        return self._keys

    @property
    def positions(self) -> list[torch.Tensor] | None:
        """Per chunk: positions [L_i] (a window's), on the CPU; None for a compressed cache."""
        if self._positions is None and self.first is not None:
            self._positions = [torch.arange(f, f + n) for f, n in zip(self.first, self.lengths, strict=True)]
        return self._positions

    def layout(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Per chunk [B] on `device`: L_i, the offset of its rows in `flat()`, and its first position (None for a
        compressed cache, which has no positions)."""
        if self.length is None:
            self.length = to_device(self.lengths, device)
        if self.first_t is None and self.first is not None:
            self.first_t = to_device(self.first, device)
        if self._offset is None:
            self._offset = torch.cumsum(self.length, 0) - self.length
        return self.length, self._offset, self.first_t

    def flat(self) -> torch.Tensor:
        """Every chunk's keys, chunk after chunk: [sum L_i, D]."""
        if self._values is None:
            if self._make is not None:
                self._values = self._make()
            elif self.paged is not None:  # every entry: which rows, the same for each cache of this layout
                rows = self.paged.ctx.memo(("cache rows", tuple(self.lengths)),
                                           lambda: segments(self.layout(self.paged.tables.device)[0],
                                                            sum(self.lengths)))
                self._values = self.paged.rows(*rows)
            else:
                self._values = torch.cat(self._keys)
        return self._values

    def rows(self, run: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Keys [M, D]: entry index[m] of chunk run[m], for 0 <= index[m] < L_i; where L_i is 0, any row."""
        if self.paged is not None and self._values is None:
            return self.paged.rows(run, index)
        _, offset, _ = self.layout(run.device)
        flat = self.flat()
        return flat[(offset[run] + index).clamp(max=flat.shape[0] - 1)]


__all__ = ["CacheView", "PagedEntries", "PagedWindow", "WindowSnapshot"]
