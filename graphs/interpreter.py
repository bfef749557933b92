"""The interpreter runtime: every node of a model's graphs through its torch reference (`dsl.interpret`).

It is what the cpu target runs, on any torch device (`deepinfer.compile(..., device="cuda")` runs the references on
a GPU, eagerly: for comparisons). Batch-invariant mode runs the ops whose reference rounds differently with the
batch through their batch-invariant implementations (`kernels`, by op name), plain torch on any device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from dsl.context import ForwardContext
from dsl.graph import Graph
from dsl.interpret import Program
from graphs.runtime import select_graph
from graphs.segments import StepSegment, step_segments


class Interpreter:
    def __init__(self, graph: Graph, params: dict[str, torch.Tensor], device: torch.device | str,
                 kernels: dict[str, Callable], draft_graph: Graph | None = None,
                 overrides: dict[str, Callable] | None = None) -> None:
        """`params` are used as they are (on `device` already, but for host-stored Engram tables); `kernels`: the
        batch-invariant implementations; `overrides`: implementations used in either mode (host Engram rows)."""
        self.graph, self.draft_graph = graph, draft_graph
        self._params = params
        self.device = torch.device(device)
        self.kernels = kernels
        self.overrides = overrides or {}
        # the graph made ready to run (dsl/interpret.py) by (draft, batch_invariant), with the implementations bound
        self._programs: dict[tuple[bool, bool], tuple[dict[str, Callable], Program]] = {}

    def implementations(self, batch_invariant: bool) -> dict[str, Callable]:
        """The ops run other than by their reference: the batch-invariant ones when asked for, the overrides."""
        return {**(self.kernels if batch_invariant else {}), **self.overrides}

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return self._params

    def ready(self) -> None:
        """Nothing to make: the references run as they are."""

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, batch_invariant: bool,
            draft: bool = False) -> dict[str, torch.Tensor]:
        kernels = self.implementations(batch_invariant)
        made = self._programs.get((draft, batch_invariant))
        if made is None or made[0] != kernels:  # made again where an implementation was replaced since
            made = self._programs[draft, batch_invariant] = (kernels, Program(self._graph(draft), kernels))
        return made[1].run({"input_ids": input_ids}, self._params, ctx)

    def graph_segments(self, num_tokens: int, draft: bool = False) -> list[StepSegment]:
        """Every node of a step runs eagerly, one by one: one segment, not captured."""
        return step_segments(self._graph(draft), num_tokens, captured=False)

    def _graph(self, draft: bool) -> Graph:
        return select_graph(self.graph, self.draft_graph, draft)

    def sampling(self) -> contextlib.AbstractContextManager:
        """Launches as they are: logits on a CUDA device sample on Triton's JIT, on the CPU with torch."""
        return contextlib.nullcontext()

    def capture_ahead(self, tokens: int) -> None:
        """Nothing is captured: every forward runs its references eagerly."""

    def save(self, path: str | Path, model_config: dict, model_dir: str | None) -> None:
        raise ValueError(f"cannot save to {path}: this model runs every op's torch reference over the checkpoint's "
                         "weights (the interpreter), so nothing is built to save; compile it again where it is "
                         "needed, or compile for a GPU target (kernels/targets.py) to save an artifact")


__all__ = ["Interpreter"]
