"""The manager behind the model runner's `TokenConstraint` hook (deepinfer/engine/model_runner.py), by sequence id.

The runner calls `fill(rows)` once per step, `accept(rows, tokens)` after sampling and `finish(seq_ids)` at the end;
a row carries its `seq_id` and `params` (SamplingParams). Each sequence has its own matcher (the n samples of a
request share the compiled grammar, through the cache). The hook has no error channel, and an exception in it would
fail every sequence of the step, so a sequence whose constraint fails (invalid, past the compile time limit, or a
sampled token the grammar refuses) gets an open row and its error is kept: the engine takes them with `pop_errors()`
after each step and finishes those requests alone with finish_reason "error". A sequence whose matcher has ended
(`is_terminated`) is finished with finish_reason "stop", ignore_eos or not.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from deepinfer.structured_outputs.manager import StructuredOutputManager
from deepinfer.structured_outputs.params import StructuredOutputError


class StructuredOutputConstraint:
    """fill / accept / finish for the model runner; `submit` early (when a request is added) to compile off the
    critical path, else the first `fill` of a sequence compiles it, waiting up to the time limit."""

    def __init__(self, manager: StructuredOutputManager) -> None:
        self.manager = manager
        self._errors: dict[Hashable, str] = {}

    def submit(self, seq_id: Hashable, params: Any) -> None:
        """Start compiling a sequence's constraint (params: its SamplingParams); a no-op for unconstrained ones."""
        constraint = params.structured_outputs
        if constraint is not None and not self.manager.has_request(seq_id) and seq_id not in self._errors:
            self.manager.add_request(seq_id, constraint)

    def fill(self, rows: Sequence[Any]) -> torch.Tensor | None:
        """int32 bitmask [len(rows), ceil(vocab / 32)] for the rows about to be sampled, None if none constrained."""
        ids = []
        for row in rows:
            self.submit(row.seq_id, row.params)
            ids.append(row.seq_id if self._ready(row.seq_id) else None)
        mask = self.manager.fill_bitmask(ids)
        return None if mask is None else mask.bitmask

    def accept(self, rows: Sequence[Any], tokens: Sequence[int]) -> None:
        """Advance each constrained sequence by its sampled token."""
        for row, token in zip(rows, tokens, strict=True):
            if row.seq_id not in self._errors and not self.manager.accept(row.seq_id, token):
                self._fail(row.seq_id, f"token {token} breaks the {row.params.structured_outputs.kind} constraint "
                                       "(a sampler that ignored the mask, or min_tokens banning the stop token)")

    def finish(self, seq_ids: Sequence[Hashable]) -> None:
        """Forget sequences that will not be sampled again."""
        for seq_id in seq_ids:
            self.manager.remove_request(seq_id)
            self._errors.pop(seq_id, None)

    def is_terminated(self, seq_id: Hashable) -> bool:
        """The sequence's grammar is complete and its stop token accepted: finish_reason "stop"."""
        return self.manager.is_terminated(seq_id)

    def pop_errors(self) -> dict[Hashable, str]:
        """{seq_id: message} of sequences whose constraint failed since the last call: fail their requests."""
        errors = {seq_id: message for seq_id, message in self._errors.items() if message}
        for seq_id in errors:
            self._errors[seq_id] = ""  # reported; kept so the sequence stays unconstrained until finished
        return errors

    def _ready(self, seq_id: Hashable) -> bool:
        if seq_id in self._errors or not self.manager.has_request(seq_id):
            return False
        try:
            return self.manager.is_ready(seq_id, wait=True)
        except StructuredOutputError as e:
            self._fail(seq_id, str(e))
            return False

    def _fail(self, seq_id: Hashable, message: str) -> None:
        self._errors[seq_id] = message
        self.manager.remove_request(seq_id)
