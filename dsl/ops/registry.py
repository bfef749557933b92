"""The op table: every DSL op's name, shape rule and reference semantics in torch, and its batch-invariant reference.

An op's reference is the oracle for every kernel that implements it and is what the `cpu` target runs.
References take torch tensors (flat over tokens: the first dim of an activation is the token dim `N`) and,
for ops that read or write per-sequence state, the forward's context as the keyword `ctx`. An op whose reference
rounds differently with the batch has a batch-invariant reference beside it (same signature; dsl/ops/invariant.py
says what they share): the cpu target's batch-invariant mode runs every one, and a GPU plan's reference nodes in that
mode those that hold on any device (`invariant_anywhere`: plain torch whose order is fixed on a GPU too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from dsl.tensor import TensorType


@dataclass(frozen=True)
class OpDef:
    name: str
    reference: Callable
    infer: Callable[..., tuple[TensorType, ...]]
    num_outputs: int = 1
    uses_context: bool = False
    invariant: Callable | None = None
    invariant_anywhere: bool = False
    sets_context: bool = False  # the reference returns the context every later node runs in (no outputs)


OPS: dict[str, OpDef] = {}


def op(name: str, infer: Callable, num_outputs: int = 1, uses_context: bool = False,
       sets_context: bool = False) -> Callable:
    """Register the decorated function as the reference of op `name`."""

    def register(fn: Callable) -> Callable:
        if name in OPS:
            raise ValueError(f"op {name!r} is defined twice")
        OPS[name] = OpDef(name, fn, infer, num_outputs, uses_context, sets_context=sets_context)
        return fn

    return register


def invariant(name: str, anywhere: bool = False) -> Callable:
    """Register the decorated function as the batch-invariant reference of op `name`; `anywhere`: it holds on any
    device, not only on the CPU."""

    def register(fn: Callable) -> Callable:
        if OPS[name].invariant is not None:
            raise ValueError(f"op {name!r} has two batch-invariant references")
        OPS[name] = replace(OPS[name], invariant=fn, invariant_anywhere=anywhere)
        return fn

    return register


def invariant_references(anywhere: bool = False) -> dict[str, Callable]:
    """Op name -> its batch-invariant reference: every one, or (`anywhere`) those that hold on any device."""
    return {name: d.invariant for name, d in OPS.items() if d.invariant and (d.invariant_anywhere or not anywhere)}


def same_as_first(x: TensorType, *rest: TensorType | None, **attrs) -> tuple[TensorType]:
    return (x,)
