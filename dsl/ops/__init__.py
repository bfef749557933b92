"""Every DSL op, registered in `OPS` by importing its family's module."""

from dsl.ops import attention, compressor, dense, engram, hyper, indexer, moe, replay, rope, rounding  # noqa: F401
from dsl.ops.registry import OPS, OpDef, op

__all__ = ["OPS", "OpDef", "op"]
