"""What a lowering is: which kernel serves a DSL node, and how. One `Lowering` per kernel template, in its family's
folder (kernels/<family>/lowering.py); kernels/registry.py collects them.

A lowering reads a node and the weights to decide whether its kernel applies and with which static shapes (`static`:
its family's frozen dataclass of the dims the weights fix; `on_target` adapts them to a target where the kernel's
form follows it), names the weight formats the kernel wants (`formats`), says
which of its GEMMs serve a bucket (`gemms`: the linear family's decode, prefill or fp8-rows GEMM; nothing for the
others), gives its heuristic config for a bucket (`default_config`) and fills in a chosen config's keys the tuner does
not search (`complete`), runs the kernel on a node's runtime arguments (`run`), calls its wrappers on meta tensors of
a bucket's token count for the ahead-of-time builder (`trace`), and turns a config into its batch-invariant form
(`invariant`). A call takes one record, `Call`. Nodes over compressed entries (a `Ragged`, flat over E) run on their
rows, or get the `Ragged` itself where `ragged` is set.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

import torch

from dsl.graph import Node
from dsl.tensor import TensorType, num_entries, num_tokens
from kernels.targets import Target

Params = dict[str, torch.Tensor]
TRITON, TILELANG = "triton", "tilelang"  # the kernel languages (`Target.backends` names them)


@dataclass(frozen=True)
class Static:
    """A template's static shapes: each family's subclass names the dims the weights fix. With the variant, they key
    the tuning cache (`Lowering.key`)."""

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class Variant:
    """Which form of its template's kernel serves a node: the backend (the target's preferred one among the template's,
    where it builds: graphs/passes/select_kernels.py), and in plans with fp8 activations the e4m3 forms
    (graphs/passes/fp8_activations.py): `e4m3_out`, the node writes its output as e4m3 rows for the fp8 linears that
    alone read it; `e4m3_in`, a linear takes such rows as they are."""

    backend: str = TRITON
    e4m3_out: bool = False
    e4m3_in: bool = False


PLAIN = Variant()  # Triton, no e4m3 form


@dataclass(frozen=True)
class Call:
    """One call of a kernel node at one bucket: its static shapes, variant, config and attributes, whether it
    multiplies in fp32, the GEMMs its projections run (`gemms`); the runtime arguments and the forward's context for
    `Lowering.run`, the bucket's token count for `Lowering.trace`."""

    static: Any
    variant: Variant
    config: dict
    attrs: dict
    dot_fp32: bool = False
    gemms: tuple[str, ...] = ()
    args: Sequence[Any] = ()
    ctx: Any = None
    tokens: int = 0


class Lowering:
    """The base of every template's lowering (the module docstring says what each method does)."""

    template: ClassVar[str]  # the kernel template: the tuning cache's op name
    ops: ClassVar[tuple[str, ...]]  # the DSL ops it serves
    static_type: ClassVar[type[Static]]
    # the modules of the kernels it runs: their @triton.jit (and TileLang) sources key its tuned configs
    sources: ClassVar[tuple[ModuleType, ...]]
    backends: ClassVar[tuple[str, ...]] = (TRITON,)  # the kernel languages it has
    ragged: ClassVar[bool] = False
    writes_e4m3: ClassVar[bool] = False  # has an `e4m3_out` form (`Variant`)

    def static(self, node: Node, params: Params) -> Static | None:
        """The node's static shapes, or None: the kernel does not apply to it (its reference runs)."""
        raise NotImplementedError

    def on_target(self, static: Any, target: Target) -> Any:
        """The static shapes on `target`, where the kernel's form depends on the target (a weight layout its MMA
        wants); by default the same."""
        return static

    def formats(self, static: Any) -> dict[int, str]:
        """Input position -> the weight format the kernel takes ("bf16", "fp32", "plain", "prescaled", "raw", ...)."""
        return {}

    def gemms(self, static: Any, tokens: int, dot_fp32: bool) -> tuple[str, ...]:
        return ()

    def tunable(self, gemms: tuple[str, ...]) -> bool:
        """Whether tuned configs serve a bucket whose projections run `gemms` (else its heuristic does)."""
        return True

    def default_config(self, static: Any, tokens: int, variant: Variant = PLAIN, gemms: tuple[str, ...] = ()) -> dict:
        raise NotImplementedError

    def run(self, call: Call) -> Any:
        raise NotImplementedError

    def trace(self, call: Call) -> None:
        raise NotImplementedError

    def complete(self, config: dict, static: Any, tokens: int) -> dict:
        """A config the plan chose for a bucket of `tokens` (tuned or heuristic) with the keys the tuner does not
        search filled from the heuristic; the base has none, so returns it as it is."""
        return config

    def invariant(self, config: dict) -> dict:
        """A config's batch-invariant form. Any fixed config of these kernels is invariant (fixed tiles, split-K counts
        and K ranges; rows never share a reduction), except where a split follows the batch: the default is a copy."""
        return dict(config)

    def fp8_activations(self, static: Any) -> Static | None:
        """The static shapes of the form with e4m3 activations, or None: there is none."""
        return None

    def takes_e4m3(self, static: Any) -> bool:
        """Whether the node can take e4m3 rows as its first input (`Variant.e4m3_in`)."""
        return False

    def whole(self, static: Static, expert_shards: int) -> Static:
        """The static shapes of the whole layer whose share, one of `expert_shards`, a node holds (expert parallelism
        splits only the routed experts): what the tuning cache keys, since configs are tuned on whole layers."""
        return static

    def key(self, static: Static, variant: Variant) -> dict[str, Any]:
        """The static shapes as the tuning cache keys them: with the backend where the template has several, and the
        e4m3 forms, since a config is measured on one kernel."""
        key = static.fields() | ({"kernel": variant.backend} if len(self.backends) > 1 else {})
        return key | ({"e4m3_out": True} if variant.e4m3_out else {}) | ({"e4m3_in": True} if variant.e4m3_in else {})


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


def token_planes(t: TensorType | None) -> tuple[int, int] | None:
    """(a, b) of a tensor [N, a, b] over the tokens (the hyper-connections' streams, heads of queries), else None."""
    if t is None or t.rank != 3 or t.shape[0] != num_tokens:
        return None
    return int(t.shape[1]), int(t.shape[2])


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def weight_dtype(fmt: str, dot_fp32: bool) -> torch.dtype:
    return {"fp8": torch.float8_e4m3fn, "fp4": torch.uint8}.get(fmt, torch.float32 if dot_fp32 else torch.bfloat16)


_exact_counts = contextvars.ContextVar("exact_counts", default=False)


def traced_counts(tokens: int, one_token_too: bool) -> tuple[int, ...]:
    """The token counts `Lowering.trace` runs under a bucket's config: the bucket's, and one token's where one token
    launches other kernels under that config (`one_token_too`), so the ahead-of-time builder builds those too; inside
    `exact_counts()` only the bucket's."""
    return (tokens, 1) if one_token_too and tokens > 1 and not _exact_counts.get() else (tokens,)


@contextlib.contextmanager
def exact_counts() -> Iterator[None]:
    """Traces run the token count they are given and no other (`traced_counts`): what one step of that many tokens
    launches (bench/step_launches.py)."""
    token = _exact_counts.set(True)
    try:
        yield
    finally:
        _exact_counts.reset(token)


__all__ = ["PLAIN", "TILELANG", "TRITON", "Call", "Lowering", "Params", "Static", "Variant", "exact_counts", "meta",
           "over_rows", "over_tokens", "param", "token_planes", "traced_counts", "weight_dtype"]
