"""Tensors computed from a weight, kept with it while it is unchanged: a decode step then reads them rather than
running the ops that make them again (an index, a view) at every call."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


def derived(weight: torch.Tensor, key: Hashable, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`make()` (made outside inference mode), kept on `weight` under `key` until `weight` is written in place (its
    version counter moves). An inference tensor has no version counter to tell that: for it `make()` runs every
    time."""
    try:
        version = weight._version
    except RuntimeError:
        return make()
    kept = weight.__dict__.get("_deepinfer_derived")
    if kept is None:
        kept = weight.__dict__["_deepinfer_derived"] = {}
    hit = kept.get(key)
    if hit is not None and hit[0] == version:
        return hit[1]
    with torch.inference_mode(False):  # a normal tensor, which code outside inference mode may read too
        value = make()
    kept[key] = (version, value)
    return value


__all__ = ["derived"]
