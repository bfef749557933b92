"""Per-forward context and per-sequence state, read by the ops that look across tokens.

A forward runs over the flat concatenation of one chunk of tokens from each of several sequences. The ops
that attend, pool or hash across tokens need to know where each chunk lies, at which positions, and where the
sequence's caches from earlier forwards live: its slot and block table in a `PagedCache` (dsl/cache.py), or,
for a state made without one, tensors of its own (dsl/unpaged_cache.py).

When every sequence of a forward lives in the same pools (the engine's case), `ForwardContext.paged` describes the
whole batch as tensors, and the cache ops read and write every chunk at once with a few tensor ops whatever the
number of sequences; otherwise they go chunk by chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from dsl.cache import PagedCache
from dsl.transfer import host_to, to_device
from dsl.unpaged_cache import UNPAGED, UnpagedCache


@dataclass
class SequenceState:
    """What one sequence carries between forwards: its length so far and where its caches live.

    With `cache` set, the sequence owns slot `slot` of the pools and `block_table[i]` is the block holding positions
    i * block_size .. (i + 1) * block_size - 1 of every compressed cache; the pools' owner fills the table before a
    forward reaches those positions. Without, the caches are tensors in `caches`.
    """

    num_tokens: int = 0
    cache: PagedCache | None = None
    slot: int = 0
    block_table: list[int] = field(default_factory=list)
    caches: dict[str, Any] = field(default_factory=dict)

    @property
    def storage(self) -> PagedCache | UnpagedCache:
        """Where the cache ops read and write this sequence's caches."""
        return UNPAGED if self.cache is None else self.cache


@dataclass
class Chunk:
    state: SequenceState
    start: int  # first row of this chunk in the forward's flat token dim
    length: int

    @property
    def start_pos(self) -> int:
        return self.state.num_tokens

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


def cast(t: torch.Tensor, dtype: torch.dtype | None = None, device: torch.device | None = None) -> torch.Tensor:
    """`t.to(dtype, device)`, skipped where `t` is already so: a no-op `.to` still costs a dispatch."""
    if (dtype is None or t.dtype == dtype) and (device is None or t.device == device):
        return t
    return t.to(device=device, dtype=dtype)


def take_rows(values: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """values[rows], or `values` itself where `rows` is None (every row its own: `PagedBatch.ring_targets`)."""
    return values if rows is None else values[rows]


def segments(counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For runs of counts[i] items laid end to end (`total` their sum, known to the host: no sync), each item's run
    and its index within the run: ([total], [total])."""
    run = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts, output_size=total)
    begin = torch.cumsum(counts, 0) - counts
    return run, torch.arange(total, device=counts.device) - begin[run]


@dataclass
class Draws:
    """The tokens a step draws after each chunk's last token, asked of a runtime that can draw them inside the step's
    graph (a GPU target's static step, dsl/step.py): per chunk `factors` (1 / temperature; 0: the argmax) and `seeds`
    (int64), each token drawn at the position after its chunk, as `deepinfer.sampler.sample_plain` draws it. The
    step sets `tokens` (int64 [num chunks], on the device) where it drew them; None: draw them from the logits."""

    factors: list[float]
    seeds: list[int]
    tokens: torch.Tensor | None = None


class ForwardContext:
    """One forward's layout: chunks, absolute positions [N], and which rows need logits.

    As host ints: `starts` (each chunk's first position) and `lengths`; as tensors on the device: `chunk_starts`,
    `chunk_lengths`, `chunk_rows` (each chunk's first row) [B] and `row_chunks` [N] (each row's chunk).
    `visible_from` (None: 0 for each): per chunk the first position its windows see. `draws`: the tokens to draw
    inside the step's graph, if it can (`Draws`).
    """

    def __init__(self, states: list[SequenceState], lengths: list[int], device: torch.device | str = "cpu",
                 logit_rows: torch.Tensor | None = None, visible_from: list[int] | None = None,
                 draws: Draws | None = None) -> None:
        self.chunks: list[Chunk] = []
        start = 0
        for state, length in zip(states, lengths, strict=True):
            self.chunks.append(Chunk(state, start, length))
            start += length
        self.num_tokens = start
        self.device = torch.device(device)
        self.starts = [c.start_pos for c in self.chunks]
        self.lengths = [c.length for c in self.chunks]
        self.logit_rows = logit_rows
        self.visible_from = visible_from
        self.draws = draws
        self._logits_kept: torch.Tensor | None = None  # which logit rows the decoder view keeps (`full_logits`)
        self._memo: dict = {}

    @cached_property
    def _layout(self) -> tuple[torch.Tensor, ...]:
        """The device tensors below, made when first read (a static step, dsl/step.py, reads none of them): one copy
        of the positions, each row's chunk, then the chunks' starts, lengths and first rows."""
        meta = torch.tensor([self.starts, self.lengths, [c.start for c in self.chunks]], dtype=torch.long)
        meta = meta.reshape(3, len(self.chunks))
        n = self.num_tokens
        run = torch.repeat_interleave(torch.arange(len(self.chunks)), meta[1], output_size=n)
        both = host_to(torch.cat([torch.arange(n) + (meta[0] - meta[2])[run], run, meta.reshape(-1)]), self.device)
        return (both[:n], both[n: 2 * n], *both[2 * n:].view(3, len(self.chunks)))

    positions = property(lambda self: self._layout[0])
    row_chunks = property(lambda self: self._layout[1])
    chunk_starts = property(lambda self: self._layout[2])
    chunk_lengths = property(lambda self: self._layout[3])
    chunk_rows = property(lambda self: self._layout[4])

    def memo(self, key: tuple, make: Callable[[], Any]) -> Any:
        """`make()`, once per forward for each `key`: the index tensors every layer of a kind shares."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def entry_layout(self, first: list[int], counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                         torch.Tensor | None]:
        """Where new compressed entries go (per chunk, `counts` of them from entry index `first`), on the device: per
        chunk [B] its cache's length after them and that cache's offset in a flat view of every chunk's cache; per
        entry [E] its chunk and its entry index (None where E is 0). Set by the layout alone, which a layer's KV
        entries and index keys share: made once per forward and layout, by their rotation or store, whichever is
        first."""
        def make() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
            lengths = [f + n for f, n in zip(first, counts, strict=True)]
            first_t, counts_t, length = to_device([*first, *counts, *lengths], self.device).view(3, len(first))
            offset = torch.cumsum(length, 0) - length
            if not sum(counts):
                return length, offset, None, None
            run, index = segments(counts_t, sum(counts))
            return length, offset, run, first_t[run] + index
        return self.memo(("entries", tuple(first), tuple(counts)), make)

    @property
    def compute_per_chunk(self) -> bool:
        """Whether the ops that compute over caches (the indexer's scores, the compressor's pooling, the reference
        attention) go chunk by chunk: on the CPU, whose results (and the fixtures made from them) come from per-chunk
        calls that a batched GEMM or softmax would round differently; elsewhere they run on the whole batch."""
        return self.device.type == "cpu"

    @cached_property
    def paged(self) -> PagedBatch | None:
        """The batch in its pools when every sequence has a slot of the same `PagedCache` (distinct slots), else
        None. Read by the cache ops during the forward, before `commit`."""
        states = [c.state for c in self.chunks]
        cache = states[0].cache if states else None
        if cache is None or any(s.cache is not cache for s in states) or len({s.slot for s in states}) < len(states):
            return None
        return PagedBatch(self, cache)

    def window_kept(self, window: int) -> list[int]:
        """Per chunk, how many of the positions just before it a window of `window` (which keeps `window - 1`) shows
        it: at most `window - 1`, none before the chunk's `visible_from`."""
        floors = self.visible_from or [0] * len(self.chunks)
        return [max(0, min(s - f, window - 1)) for s, f in zip(self.starts, floors, strict=True)]

    def _replayed(self) -> list[int]:
        """Per chunk, its leading rows that lie before its sequence's `replay_from`."""
        return [min(max(c.state.replay_from - c.start_pos, 0), c.length) for c in self.chunks]

    def replay_rows(self, window: int) -> torch.Tensor | None:
        """The rows [M] the decoder layers run over (see `decoder_view`); None where they are all N."""
        view = self.decoder_view(window)
        return None if view is self else self.memo(("replay rows",), lambda: host_to(torch.cat(
            [torch.arange(c.start + d, c.start + c.length) for c, d in zip(self.chunks, self._replayed(),
                                                                           strict=True)]), self.device))

    def decoder_view(self, window: int) -> ForwardContext:
        """This forward as the decoder layers see it in bounded replay: each chunk's rows from its sequence's
        `replay_from` on (a chunk wholly before it keeps none), at their positions, with windows of up to `window`
        seeing nothing before `replay_from`, and the logit rows among them. Itself where that changes nothing."""
        def make() -> ForwardContext:
            drops = self._replayed()
            floors = [c.state.replay_from for c in self.chunks]
            if not any(drops) and all(f == 0 or s - f >= window - 1 for s, f in zip(self.starts, floors, strict=True)):
                return self
            states = [dataclasses.replace(c.state, num_tokens=c.start_pos + d) for c, d in zip(self.chunks, drops,
                                                                                               strict=True)]
            view = ForwardContext(states, [c.length - d for c, d in zip(self.chunks, drops, strict=True)],
                                  self.device, visible_from=floors)
            view.logit_rows, self._logits_kept = self._kept_logit_rows(drops)
            return view
        return self.memo(("decoder view", window), make)

    def _kept_logit_rows(self, drops: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The decoder view's logit rows (None: all its rows), and which of this forward's logit rows they are
        (a mask over them; None where every one is kept)."""
        wanted = self.logit_rows if self.logit_rows is not None else torch.arange(self.num_tokens, device=self.device)
        drop = to_device(drops, self.device)
        chunk = self.row_chunks[wanted]
        kept = wanted - self.chunk_rows[chunk] >= drop[chunk]  # [R]
        if self.logit_rows is None:
            return None, kept
        return (wanted - torch.cumsum(drop, 0)[chunk])[kept], kept

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over every logit row of the forward from the graph's output `logits`, which in bounded replay holds
        only the decoder view's: the rows the view dropped (all of a chunk wholly before its `replay_from`) are NaN:
        not computed, as no sample reads them."""
        kept = self._logits_kept
        if kept is None or logits.shape[0] == kept.shape[0]:
            return logits
        out = logits.new_full((kept.shape[0], *logits.shape[1:]), float("nan"))
        out[kept] = logits
        return out

    def commit(self) -> None:
        """Advance every sequence past the tokens of this forward; call once, after the forward."""
        for c in self.chunks:
            c.state.num_tokens += c.length


class PagedBatch:
    """A forward's sequences in one `PagedCache`: `slots` [B] and block tables `tables` [B, W] (zero-padded rows) on
    the pools' device, beside the context's layout (`ctx`)."""

    def __init__(self, ctx: ForwardContext, cache: PagedCache) -> None:
        self.ctx, self.cache = ctx, cache
        states = [c.state for c in ctx.chunks]
        width = max([1, *(len(s.block_table) for s in states)])
        # One copy to the device: the zero-padded tables row by row, then the slots (the tables stay contiguous at the
        # copy's start, as the cache kernels take them).
        both = to_device([b for s in states for b in s.block_table + [0] * (width - len(s.block_table))]
                         + [s.slot for s in states], cache.device)
        self.tables, self.slots = both[: len(states) * width].view(len(states), width), both[len(states) * width:]

    def ring_targets(self, ring: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where to store the forward's N rows in a ring of `ring` positions per slot: the slots [N] and which row of
        the values each takes [N] (`take_rows`), None where each takes its own (no chunk longer than the ring). Where
        two tokens of a chunk share a ring row, both take the later one's values, so one scatter of all N rows
        writes the same values in any order."""
        def make() -> tuple[torch.Tensor, torch.Tensor | None]:
            ctx = self.ctx
            slots = ctx.memo(("row slots",), lambda: self.slots[ctx.row_chunks])
            if max(ctx.lengths, default=0) <= ring:  # rows + left // ring * ring is rows itself
                return slots, None
            rows = torch.arange(ctx.num_tokens, device=ctx.device)
            left = ctx.chunk_rows[ctx.row_chunks] + ctx.chunk_lengths[ctx.row_chunks] - 1 - rows  # [N] rows after it
            return slots, rows + left // ring * ring
        return self.ctx.memo(("ring", ring), make)

    def before(self, counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The last counts[i] positions before chunk i's first token, chunk after chunk (`total` in all): their
        chunks, slots and positions, each [total]."""
        run, index = segments(counts, total)
        positions = (self.ctx.chunk_starts - counts)[run] + index
        return run, self.slots[run], positions
