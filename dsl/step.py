"""A decode or verification step's layout as device tensors whose shapes follow a token-count bucket alone.

`ForwardContext` (dsl/context.py) describes a forward with host lists and device tensors sized by its chunks, and the
cache ops built on it make tensors whose shapes follow the caches' lengths. A `StaticStep` describes a step of up to
`rows` tokens (a bucket: the step's N tokens, then padding rows) in which every chunk fits its sequence's window
rings (`fits`): per row its position and chunk, per chunk its slot, first position, first row, window floor and block
table, all at fixed places in one buffer that `fill` refreshes from a `ForwardContext` with one copy from pinned
host memory. The ops with a static form (`STATIC_OPS`) read only these tensors and make only tensors whose shapes
follow `rows` and static bounds, so a CUDA graph captured over them serves every later step of the bucket: a replay
reads what `fill` wrote.

Padding rows lie at position 0 of chunk 0, so what they read exists; they write nothing (`write_slots` is -1 there).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from dsl.cache import PagedCache
from dsl.graph import Node

_ALIGN = 16  # bytes: every region starts at an address a kernel argument may have

# (name, dtype, rows of `rows` entries each, whether it has one entry per block table column): the buffer's regions
_REGIONS = (("positions", torch.int64, False), ("positions32", torch.int32, False),
            ("row_chunks", torch.int32, False), ("write_slots", torch.int32, False),
            ("chunk_slots", torch.int32, False), ("chunk_starts", torch.int32, False),
            ("chunk_rows", torch.int32, False), ("chunk_ends", torch.int32, False), ("floors", torch.int32, False),
            ("draw_factors", torch.float64, False), ("draw_seeds", torch.int64, False),
            ("draw_positions", torch.int64, False), ("tables", torch.int32, True))


def _size(rows: int, width: int, dtype: torch.dtype, tabular: bool) -> int:
    size = rows * (width if tabular else 1) * dtype.itemsize
    return -(-size // _ALIGN) * _ALIGN


def table_width(longest: int) -> int:
    """The block tables' width for a step whose longest table has `longest` blocks: a power of two, at least 8, so a
    sequence's growth changes it (and the graphs captured for it) only a few times over its life."""
    width = 8
    while width < longest:
        width *= 2
    return width


def _regions(buffer: torch.Tensor, rows: int, width: int) -> dict[str, torch.Tensor]:
    """The typed views of a step's byte buffer (device or host), by region name."""
    views, at = {}, 0
    for name, dtype, tabular in _REGIONS:
        count = rows * (width if tabular else 1)
        view = buffer[at: at + count * dtype.itemsize].view(dtype)
        views[name] = view.view(rows, width) if tabular else view
        at += _size(rows, width, dtype, tabular)
    return views


class StaticStep:
    """The layout of a step of up to `rows` tokens whose sequences live in `cache`, block tables `width` wide.

    Per row [rows]: `positions` (int64, and `positions32`), `row_chunks` (its chunk), `write_slots` (its sequence's
    slot; -1 for padding rows, which store nothing). Per chunk [rows] (a step has at most one chunk a row; those past
    the step's are zeros): `chunk_slots`, `chunk_starts` (first position), `chunk_rows` (first row), `chunk_ends`
    (the position after its last token: a compressed cache of ratio r holds chunk_ends // r entries after the step),
    `floors` (the first position its windows see: 0, or bounded replay's `replay_from`) and `tables` [rows, width]
    (zero-padded). Per row, the token the step draws after it (`dsl.context.Draws`, its chunk's): `draw_factors`
    (float64; 0, the argmax, where no draws are asked for and on padding rows), `draw_seeds` and `draw_positions`
    (the row's position + 1).
    """

    def __init__(self, rows: int, width: int, cache: PagedCache, device: torch.device | str | None = None) -> None:
        if rows < 1 or width < 1:
            raise ValueError(f"a static step needs at least one row and one table column, got {rows} and {width}")
        self.rows, self.width, self.cache = rows, width, cache
        self.device = torch.device(device) if device is not None else cache.device
        self.buffer = torch.zeros(sum(_size(rows, width, d, t) for _, d, t in _REGIONS), dtype=torch.uint8,
                                  device=self.device)
        views = _regions(self.buffer, rows, width)
        self.positions: torch.Tensor = views["positions"]
        self.positions32: torch.Tensor = views["positions32"]
        self.row_chunks: torch.Tensor = views["row_chunks"]
        self.write_slots: torch.Tensor = views["write_slots"]
        self.chunk_slots: torch.Tensor = views["chunk_slots"]
        self.chunk_starts: torch.Tensor = views["chunk_starts"]
        self.chunk_rows: torch.Tensor = views["chunk_rows"]
        self.chunk_ends: torch.Tensor = views["chunk_ends"]
        self.floors: torch.Tensor = views["floors"]
        self.draw_factors: torch.Tensor = views["draw_factors"]
        self.draw_seeds: torch.Tensor = views["draw_seeds"]
        self.draw_positions: torch.Tensor = views["draw_positions"]
        self.tables: torch.Tensor = views["tables"]
        self.write_slots.fill_(-1)  # nothing to store until filled
        self.num_tokens = rows  # the rows every op of the step runs over
        self.logit_rows = None  # every row's logits: a forward that wants fewer does not fit (`fits`)
        # the host side of `fill`'s copy, pinned on a GPU, and the event after the copy that last read it
        pinned = self.device.type == "cuda"
        self._host = torch.zeros(self.buffer.shape[0], dtype=torch.uint8, pin_memory=pinned)
        self._host_views = {name: view.numpy() for name, view in _regions(self._host, rows, width).items()}
        self._copied = torch.cuda.Event() if pinned else None
        self._tables: list[list[int] | None] = [None] * rows  # what each host table row holds (None: zeros)

    def fill(self, ctx) -> None:
        """Write the layout of forward `ctx` (a `ForwardContext` whose every chunk `fits` this step): one packed host
        buffer, kept from step to step, copied to the device in one asynchronous copy from pinned memory."""
        states, n = [c.state for c in ctx.chunks], ctx.num_tokens
        if n > self.rows or any(len(s.block_table) > self.width for s in states):
            raise ValueError(f"a step of {n} tokens with block tables of up to "
                             f"{max(len(s.block_table) for s in states)} blocks does not fit a static step of "
                             f"{self.rows} rows and {self.width} table columns")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffer (long since, as a rule)
        host, views = self._host, self._host_views  # numpy views of the pinned host buffer: a step's few ints
        for name, _, tabular in _REGIONS:  # every region past the step's rows and chunks holds zeros
            if not tabular:
                views[name].fill(0)
        b = len(states)
        lengths, starts = np.asarray(ctx.lengths, dtype=np.int64), np.asarray(ctx.starts, dtype=np.int64)
        chunks = np.repeat(np.arange(b), lengths)
        rows = np.cumsum(lengths) - lengths
        positions = np.arange(n) - rows[chunks] + starts[chunks]
        views["positions"][:n] = positions
        views["positions32"][:n] = positions
        views["row_chunks"][:n] = chunks
        slots = np.fromiter((s.slot for s in states), dtype=np.int32, count=b)
        views["write_slots"][:n] = slots[chunks]
        views["write_slots"][n:] = -1
        views["chunk_slots"][:b] = slots
        views["chunk_starts"][:b] = starts
        views["chunk_rows"][:b] = rows
        views["chunk_ends"][:b] = starts + lengths
        if ctx.visible_from is not None:
            views["floors"][:b] = ctx.visible_from
        views["draw_positions"][:n] = positions + 1
        if ctx.draws is not None:
            views["draw_factors"][:n] = np.asarray(ctx.draws.factors, dtype=np.float64)[chunks]
            views["draw_seeds"][:n] = np.asarray(ctx.draws.seeds, dtype=np.int64)[chunks]
        # block tables change a block at a time: only the rows that differ from what the host buffer holds are written
        # (a Python list compares at C speed; making the whole [B, width] table from lists each step would not)
        tables = views["tables"]
        for i, kept in enumerate(self._tables):
            table = states[i].block_table if i < b else None
            if table == kept:
                continue
            tables[i].fill(0)
            if table:
                tables[i, : len(table)] = table
            self._tables[i] = list(table) if table is not None else None
        self.buffer.copy_(host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def ring_slots(self) -> torch.Tensor:
        """int64 [R]: the slot each row's ring rows (partial groups, n-gram history) go to: its sequence's, and for
        padding rows the pools' scratch slot, since a CUDA graph cannot leave them out without waiting for the
        device."""
        return torch.where(self.write_slots >= 0, self.write_slots, self.cache.scratch_slot).long()

    def memo(self, key: tuple, make: Callable[[], object]) -> object:
        """`make()`: what `ForwardContext.memo` keeps for a forward, a static step computes each time, since its
        tensors hold a new step's layout at every replay."""
        return make()

    @staticmethod
    def fits(ctx, stores: bool = True) -> bool:
        """Whether forward `ctx` (a `ForwardContext`) can run as a static step: its sequences share one set of pools
        (`ctx.paged`) and every chunk fits the rings' spare positions (a decode or verification step: a chunk of T
        tokens leaves a ring of `window + spare` positions holding the window before it when T <= spare + 1), and it
        wants the logits of every token (a static step's head runs over all its rows). A forward that `stores`
        nothing (its graph has no op of `STORING_OPS`: DSpark's draft pass, which reads the window before each
        chunk) fits whatever its chunks' lengths."""
        states = [c.state for c in ctx.chunks]
        cache = states[0].cache if states else None
        if cache is None or any(s.cache is not cache for s in states) or len({s.slot for s in states}) < len(states):
            return False
        every_row = ctx.logit_rows is None or ctx.logit_rows.shape[0] == ctx.num_tokens
        return ctx.visible_from is None and every_row and (not stores or max(ctx.lengths) <= cache.spec.spare + 1)


def _producer(node: Node, index: int) -> str | None:
    """The op that makes input `index` of `node` (None for a graph input, a weight or an absent input)."""
    value = node.inputs[index] if index < len(node.inputs) else None
    return value.producer.op if value is not None and value.producer is not None else None


def _static_attention(node: Node) -> bool:
    """A causal attention over a window the step appends to, with no compressed entries or with the picks of an
    indexer over a cache the step appends to."""
    if not node.attrs.get("causal", True) or _producer(node, 1) != "kv_window_append":
        return False
    extra = [_producer(node, i) for i in (3, 4)]
    return extra == [None, None] or extra == ["cache_append", "topk_select"]


def _static_block_attention(node: Node) -> bool:
    """A DSpark draft block's attention (non-causal) over a `kv_window_block` view, with no compressed entries."""
    return (not node.attrs.get("causal", True) and _producer(node, 1) == "kv_window_block"
            and [_producer(node, i) for i in (3, 4)] == [None, None])


# The ops with a static form, each with the condition on its node: given a `StaticStep` as their context they read
# and write the caches through it alone, and make values whose shapes follow its rows and static bounds (the
# compressed entries' forms: dsl/ops/static_entries.py).
STATIC_OPS: dict[str, Callable[[Node], bool]] = {
    "kv_window_append": lambda node: True,
    "kv_window_store": lambda node: True,
    "kv_window_block": lambda node: True,
    "sparse_attention": lambda node: _static_attention(node) or _static_block_attention(node),
    "compress_pool": lambda node: True,
    "rope_entries": lambda node: True,
    "rope_entries_fp4_round": lambda node: True,
    "rms_norm_rope_entries_fp4_round": lambda node: True,
    "cache_append": lambda node: True,
    "index_scores": lambda node: _producer(node, 2) == "cache_append",
    "candidate_blocks": lambda node: True,
    "select_rows": lambda node: True,
    "engram_ngrams": lambda node: True,
}


# The ops that write the caches (window rings, compressed entries, partial groups, n-gram history).
STORING_OPS = frozenset({"kv_window_append", "kv_window_store", "cache_append", "compress_pool", "engram_ngrams"})


def has_static_form(node: Node) -> bool:
    """Whether `node` runs over a `StaticStep` (`STATIC_OPS`)."""
    check = STATIC_OPS.get(node.op)
    return check is not None and check(node)


__all__ = ["STATIC_OPS", "STORING_OPS", "StaticStep", "has_static_form", "table_width"]
