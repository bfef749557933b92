"""What a lowering is (`Lowering`: which kernel serves a DSL node, and how; graphs/lowering.py says more) and the
helpers the lowerings share: a node's weights, whether it runs over the tokens' rows, meta tensors for tracing."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsl.graph import Node
from dsl.tensor import num_entries, num_tokens

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Lowering:
    template: str  # the kernel template (tuning cache's op name)
    static: Callable[[Node, Params], dict | None]  # None: the kernel does not apply to this node
    formats: Callable[[dict], dict[int, str]]  # input position -> weight format ("bf16", "fp32", "prescaled", "raw")
    run: Callable[..., Any]  # run(args, attrs, static, config, ctx, dot_fp32) -> node outputs
    trace: Callable[..., None]  # trace(static, attrs, config, m, dot_fp32): calls the wrapper on meta
    default_config: Callable[[dict, int], dict]
    # A config's batch-invariant form. Any fixed config of these kernels is invariant (fixed tiles, split-K counts
    # and K ranges; rows never share a reduction), except where a split follows the batch: the default is a copy.
    invariant: Callable[[dict], dict] = dict
    fp8_activations: Callable[[dict], dict | None] = lambda static: None  # the static of an e4m3-input variant
    # Plans with fp8 activations, where a node's output is read only by fp8-activation linears (graphs/plan.py): the
    # static of the producer's variant that writes it as e4m3 rows (kernels/linear/fp8.py), and that of the
    # reader's variant that takes them as they are. None: no such variant.
    e4m3_out: Callable[[dict], dict | None] = lambda static: None
    e4m3_in: Callable[[dict], dict | None] = lambda static: None
    # Over compressed entries (a `Ragged`): False, `run` gets their rows and its result is wrapped back; True, it
    # gets the `Ragged` itself (the entries' layout too) and returns one.
    ragged: bool = False


def param(node: Node, i: int, params: Params) -> torch.Tensor | None:
    v = node.inputs[i]
    return None if v is None else params.get(v.name)


def over_tokens(node: Node) -> bool:
    t = node.inputs[0].type
    return t is not None and t.dtype == "float32" and len(t.shape) >= 2 and t.shape[0] == num_tokens


def over_rows(node: Node) -> bool:
    """Flat over the tokens N, or over the compressed entries E of a forward (a `Ragged` at run time)."""
    t = node.inputs[0].type
    return over_tokens(node) or (t is not None and t.dtype in ("float32", "entries") and t.rank == 2
                                  and t.shape[0] == num_entries)


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def weight_dtype(fmt: str, dot_fp32: bool) -> torch.dtype:
    return {"fp8": torch.float8_e4m3fn, "fp4": torch.uint8}.get(fmt, torch.float32 if dot_fp32 else torch.bfloat16)


__all__ = ["Lowering", "Params", "meta", "over_rows", "over_tokens", "param", "weight_dtype"]
