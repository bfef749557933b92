"""A static step's draws inside its CUDA graph: the token after each of its rows, drawn by the segment that makes
the logits.

The segment of a static step (dsl/step.py) that makes every row's logits gets one more output, `DRAWN`
(`drawing_segments`, which graphs/capture.py applies to a static step's segments), and after its nodes the executor
runs the sampling kernel (`draw`) over the logits with each row's factor, seed and position from the `StaticStep`,
so a step's tokens need no launch of their own; a forward that asked for them (`dsl.context.Draws`) takes them, the
others leave them.
"""

from __future__ import annotations

from dsl.graph import Graph, Value
from dsl.step import StaticStep
from dsl.tensor import TensorType, num_tokens
from graphs.segments import Segment
from kernels.sampling.gumbel_argmax import gumbel_argmax

# The tokens a static step draws after its rows (int64 [N]): an output of the segment that makes the logits.
DRAWN = Value("drawn", TensorType((num_tokens,), "int64"))


def drawing_segments(graph: Graph, segments: list[Segment]) -> list[Segment]:
    """A static step's segments, the one that makes every row's logits (the graph's output "logits", [N, vocab])
    drawing the tokens after them too (`DRAWN`)."""
    logits = graph.outputs.get("logits")
    out = []
    for s in segments:
        if logits is not None and any(v is logits and r for v, r in zip(s.outputs, s.row_outputs, strict=True)):
            s = Segment(s.start, s.stop, s.inputs, [*s.outputs, DRAWN], True)
        out.append(s)
    return out


def draw(env: dict, logits: Value, layout: StaticStep) -> None:
    """Put the tokens drawn after the rows of `env[logits]` in `env[DRAWN]`, with the rows' factors, seeds and
    positions of `layout`."""
    env[DRAWN] = gumbel_argmax(env[logits], layout.draw_factors, layout.draw_seeds, layout.draw_positions)


__all__ = ["DRAWN", "draw", "drawing_segments"]
