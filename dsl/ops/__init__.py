"""Every DSL op, registered in `OPS` by importing its family's module (with its batch-invariant reference)."""

from dsl.ops import (  # noqa: F401
    attention,
    attention_invariant,
    compressor,
    dense,
    engram,
    hyper,
    indexer,
    moe,
    replay,
    rope,
    rounding,
)
from dsl.ops.registry import OPS, OpDef, invariant_references, op

__all__ = ["OPS", "OpDef", "invariant_references", "op"]
