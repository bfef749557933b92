"""What runs a compiled model's graphs: the target record's `runtime` (kernels/targets.py) picks one.

`Interpreter` (graphs/interpreter.py) runs every node through its torch reference, the DSL's semantics, on any torch
device; `PlanRuntime` (graphs/plan_runtime.py) runs a plan: kernel nodes on cubins built ahead of time, launched
through the CUDA driver and replayed as CUDA graphs, the rest on their references. `CompiledModel`
(graphs/compiled_model.py) holds one and does the rest of a step (checks, the forward's context, logit rows) alike
for both.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import torch

from dsl.context import ForwardContext
from dsl.graph import Graph
from graphs.segments import StepSegment


class FatalRuntimeError(RuntimeError):
    """A run that leaves nothing able to run after it (a rank of several failed or is gone): the engine stops rather
    than failing the step's requests and going on."""


def select_graph(graph: Graph, draft_graph: Graph | None, draft: bool) -> Graph:
    """The main graph, or the DSpark draft graph when `draft` (an error naming the fix where there is none)."""
    if not draft:
        return graph
    if draft_graph is None:
        raise RuntimeError("this model was compiled without DSpark drafting: compile(..., drafting=True)")
    return draft_graph


class Runtime(Protocol):
    """A model's main graph (and its DSpark draft graph, where compiled with drafting) with its weights on a device."""

    device: torch.device

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The weights by checkpoint name, as the runtime holds them."""
        ...

    def ready(self) -> None:
        """Make what the first run needs, or say why it cannot run here (no such device)."""
        ...

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, batch_invariant: bool,
            draft: bool = False) -> dict[str, torch.Tensor]:
        """The outputs of the main graph (the draft graph when `draft`) over `input_ids` [N] on the device; with
        `batch_invariant`, every row's values are bitwise independent of the other rows and their number."""
        ...

    def graph_segments(self, num_tokens: int, draft: bool = False) -> list[StepSegment]:
        """How a step of `num_tokens` tokens runs the graph: the stretches replayed as CUDA graphs and the nodes run
        one by one between them, in order (graphs/segments.py)."""
        ...

    def sampling(self) -> AbstractContextManager:
        """What the engine samples in (the launcher the sampling kernel's launches go to)."""
        ...

    def capture_ahead(self, tokens: int) -> None:
        """The most tokens a decode step runs, for runtimes that capture CUDA graphs per token count."""
        ...

    def save(self, path: str | Path, model_config: dict, model_dir: str | None) -> None:
        """Write what was built as an artifact directory (graphs/artifact.py), or say why there is nothing to save."""
        ...


__all__ = ["FatalRuntimeError", "Runtime", "select_graph"]
