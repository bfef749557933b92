"""Tensor types of the DSL: a dtype and a shape whose dims are integers or sympy expressions."""

from __future__ import annotations

from dataclasses import dataclass

import sympy

Dim = int | sympy.Expr

# The symbols the model's graphs are written over. Every per-forward size is one of these.
num_tokens = sympy.Symbol("N", integer=True, nonnegative=True)  # tokens in this forward, all sequences
num_entries = sympy.Symbol("E", integer=True, nonnegative=True)  # compressed entries completed in this forward
context = sympy.Symbol("C", integer=True, nonnegative=True)  # compressed entries visible to a sequence

# dtypes that are not torch dtypes: a cache view (a sequence's window or compressed entries) and a ragged
# list of new compressed entries, which the reference ops carry as python objects.
OPAQUE_DTYPES = ("cache", "entries")


@dataclass(frozen=True)
class TensorType:
    shape: tuple[Dim, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for d in self.shape:
            if not isinstance(d, (int, sympy.Expr)) or (isinstance(d, int) and d < 0):
                raise TypeError(f"dim {d!r} of {self.shape} is neither a non-negative int nor a sympy expression")

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, *shape: Dim) -> TensorType:
        return TensorType(tuple(shape), self.dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


def dims_equal(a: Dim, b: Dim) -> bool:
    """True when two dims are provably equal."""
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0
