"""Synchronised timers around an executor's nodes and CUDA-graph segments (bench/step_profile.py,
bench/dspark_bench.py --nodes): each eager node, and each segment (replayed, captured or run eagerly), is timed
between two device synchronisations (none while a segment is being captured) and added up by op, so host and GPU time add up without the overlap a real
step has."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import torch


def timer(ms: collections.Counter, calls: collections.Counter) -> Callable:
    """`timed(key, fn, *args)`: fn(*args), its synchronised ms added to `ms[key]` and a call to `calls[key]`."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def timed(key: str, fn: Callable, *args, **kwargs):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return fn(*args, **kwargs)  # a node being captured: a synchronisation would break the capture
        sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            ms[key] += 1e3 * (time.perf_counter() - start)
            calls[key] += 1
    return timed


def time_nodes(executor, timed: Callable, prefix: str = "") -> Callable[[], None]:
    """Time `executor`'s eager nodes by op and its segments as one key; returns what undoes it."""
    graph, node, graphs = executor.graph, executor._node, executor.cuda_graphs
    executor._node = lambda i, *a: timed(prefix + graph.nodes[i].op, node, i, *a)
    if graphs is None:
        return lambda: setattr(executor, "_node", node)
    begin = graphs.begin

    def begin_timed(*a):
        forward = begin(*a)
        if forward is not None:
            run = forward.run
            forward.run = lambda segment, env, nodes: timed(prefix + "segment (graph replay or eager)", run, segment,
                                                            env, nodes)
        return forward
    graphs.begin = begin_timed

    def undo() -> None:
        executor._node, graphs.begin = node, begin
    return undo


__all__ = ["time_nodes", "timer"]
