"""The op table: every DSL op's name, shape rule and reference semantics in torch.

An op's reference is the oracle for every kernel that implements it and is what the `cpu` target runs.
References take torch tensors (flat over tokens: the first dim of an activation is the token dim `N`) and,
for ops that read or write per-sequence state, the forward's context as the keyword `ctx`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from dsl.tensor import TensorType


@dataclass(frozen=True)
class OpDef:
    name: str
    reference: Callable
    infer: Callable[..., tuple[TensorType, ...]]
    num_outputs: int = 1
    uses_context: bool = False
    sets_context: bool = False  # the reference returns the context every later node runs in (no outputs)


OPS: dict[str, OpDef] = {}


def op(name: str, infer: Callable, num_outputs: int = 1, uses_context: bool = False,
       sets_context: bool = False) -> Callable:
    """Register the decorated function as the reference of op `name`."""

    def register(fn: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"op {name!r} is defined twice")
        OPS[name] = OpDef(name, fn, infer, num_outputs, uses_context, sets_context)
        return fn

    return register


def same_as_first(x: TensorType, *rest: TensorType | None, **attrs) -> tuple[TensorType]:
    return (x,)
