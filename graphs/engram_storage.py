"""Engram tables in host memory: each forward's table rows fetched while the layers before each Engram layer run.

A forward's n-grams are known once `engram_ngrams` has run (it reads only the token ids and each sequence's last
ids), before the first layer. So there every Engram layer's row ids are hashed and a worker thread gathers their
rows from the host table (as loaded: in memory or the memory-mapped checkpoint), pins them and copies them to the
device, one layer after another; at each Engram
layer (`engram_hash_rows`) the forward takes that layer's rows, waiting only for what the layers before it did not
hide. The rows are the same bytes, dequantised by the same function, so the values are bitwise those of a table on
the device. On the cpu the host is the device: the table stays where it is and the same path runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dsl.graph import Graph
from dsl.ops.engram import engram_hash, engram_ngrams
from dsl.quant import dequantize_fp8_group

TABLE_SUFFIXES = (".engram.embed.weight", ".engram.embed.scale")  # the parameters that stay on the host
STORAGES = ("host", "device")


def is_engram_table(name: str) -> bool:
    return name.endswith(TABLE_SUFFIXES)


def choose_storage(params: dict[str, torch.Tensor], device: torch.device, storage: str | None) -> str:
    """`storage` checked, or when None: "host" where the tables take more than half of a GPU's free memory."""
    if storage is not None:
        if storage not in STORAGES:
            raise ValueError(f"engram_storage must be 'host', 'device' or None (chosen by size), got {storage!r}")
        return storage
    if device.type != "cuda":
        return "device"
    tables = sum(t.nbytes for name, t in params.items() if is_engram_table(name))
    return "host" if tables > torch.cuda.mem_get_info(device)[0] // 2 else "device"


@dataclass
class FetchStats:
    """Seconds the fetches took on their thread, and seconds forwards waited for them (the part not hidden)."""

    num_fetches: int = 0
    fetch_s: float = 0.0
    wait_s: float = 0.0


class HostEngramRows:
    """Fetches Engram table rows kept in host memory for forwards on `device`; `layers` are each Engram layer's
    (hash attrs, table, scale) in layer order. `overrides()` are the graph's `engram_ngrams` and `engram_hash_rows`
    implementations over it."""

    def __init__(self, layers: list[tuple[dict, torch.Tensor, torch.Tensor | None]], device: torch.device) -> None:
        self.layers, self.device = layers, device
        self.stats = FetchStats()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="engram-fetch")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending: deque[tuple[torch.Tensor, Future]] = deque()

    @classmethod
    def from_graph(cls, graph: Graph, params: dict[str, torch.Tensor], device: torch.device) -> HostEngramRows:
        """The Engram layers of `graph` (hash and rows fused: `dsl.passes.run_passes`) over the tables in `params`."""
        names = {value: name for name, value in graph.params.items()}
        if any(node.op == "engram_rows" for node in graph.nodes):
            raise ValueError("host Engram storage needs each layer's hash and rows fused (engram_hash_rows): run the "
                             "graph through dsl.passes.run_passes first")
        layers = [(node.attrs, params[names[node.inputs[1]]],
                   None if node.inputs[2] is None else params[names[node.inputs[2]]])
                  for node in graph.nodes if node.op == "engram_hash_rows"]
        return cls(layers, device)

    def overrides(self) -> dict[str, Callable]:
        return {"engram_ngrams": self.ngrams, "engram_hash_rows": self.hash_rows}

    def ngrams(self, ids: torch.Tensor, token_map: torch.Tensor, *, n: int, pad_id: int, ctx) -> torch.Tensor:
        """`engram_ngrams`, then every Engram layer's fetch started, in layer order."""
        ngrams = engram_ngrams(ids, token_map, n=n, pad_id=pad_id, ctx=ctx)
        self._pending.clear()
        for attrs, table, scale in self.layers:
            self.submit(engram_hash(ngrams, **attrs), table, scale)  # a GPU waits here for the n-grams only
        return ngrams

    def hash_rows(self, ngrams: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None = None,
                  **attrs) -> torch.Tensor:
        """This layer's rows [N, cols, d] (fp32), once its fetch is done."""
        if not self._pending or self._pending[0][0] is not table:
            raise RuntimeError("an Engram layer ran without its rows fetched at engram_ngrams (layers out of order)")
        return self.take(ngrams.shape[0])

    def submit(self, rows: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None) -> None:
        """Start fetching the rows [N, cols] of `table` (host) to the device, after those already started."""
        self._pending.append((table, self._worker.submit(self._fetch, rows.to("cpu"), table, scale)))

    def take(self, n: int) -> torch.Tensor:
        """The earliest started fetch's rows [n, cols, d] (fp32) on the device, once it is done."""
        table, fetch = self._pending.popleft()
        start = time.perf_counter()
        codes, scales = fetch.result()
        self.stats.wait_s += time.perf_counter() - start
        if self._stream is not None:
            for t in (codes, scales):
                if t is not None:
                    t.record_stream(torch.cuda.current_stream(self.device))
        if table.dtype != torch.float8_e4m3fn or scales is None:
            return codes.float().reshape(n, -1, table.shape[-1])
        return dequantize_fp8_group(codes, scales).reshape(n, -1, table.shape[-1])

    def _fetch(self, rows: torch.Tensor, table: torch.Tensor,
               scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows' codes [N * cols, d] and scales gathered on the host, then on the device (on the worker thread)."""
        start = time.perf_counter()
        flat = rows.reshape(-1)
        codes = table.index_select(0, flat)
        scales = None if scale is None else scale.index_select(0, flat)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                codes = codes.pin_memory().to(self.device, non_blocking=True)
                scales = None if scales is None else scales.pin_memory().to(self.device, non_blocking=True)
            self._stream.synchronize()
        self.stats.num_fetches += 1
        self.stats.fetch_s += time.perf_counter() - start
        return codes, scales


__all__ = ["STORAGES", "FetchStats", "HostEngramRows", "choose_storage", "is_engram_table"]
