"""Ragged values: per-sequence lists of new compressed entries, flattened into one tensor with counts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Ragged:
    """Entries completed in one forward: `values` [E, ...] holds every sequence's new entries in order;
    sequence i owns `counts[i]` rows, whose absolute entry indices start at `first[i]`."""

    values: torch.Tensor
    counts: list[int]
    first: list[int]

    def split(self) -> list[torch.Tensor]:
        return list(torch.split(self.values, self.counts))

    def replace(self, values: torch.Tensor) -> Ragged:
        return Ragged(values, self.counts, self.first)


def ragged_map(fn: Callable) -> Callable:
    """Let a per-row reference accept a `Ragged` first argument: it maps over the rows and keeps the layout."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if isinstance(x, Ragged):
            return x.replace(fn(x.values, *args, **kwargs))
        return fn(x, *args, **kwargs)

    return wrapper
