"""The pass pipeline: `run_passes(graph)` is `fuse(verify(infer_shapes(graph)))`.

`DEEPINFER_DEBUG=ir` prints the IR after each pass.
"""

from __future__ import annotations

import os
import sys

from dsl.graph import Graph
from dsl.passes.fuse import fuse
from dsl.passes.infer_shapes import infer_shapes
from dsl.passes.verify import verify

PIPELINE = [infer_shapes, verify, fuse, infer_shapes, verify]


def run_passes(graph: Graph) -> Graph:
    debug = "ir" in os.environ.get("DEEPINFER_DEBUG", "").split(",")
    for p in PIPELINE:
        graph = p(graph)
        if debug:
            print(f"// after {p.__name__}\n{graph}", file=sys.stderr)
    return graph


__all__ = ["run_passes", "infer_shapes", "verify", "fuse"]
