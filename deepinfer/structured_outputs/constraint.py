"""The structured-outputs side of the engine's `TokenConstraint` hook (deepinfer/engine/token_constraint.py).

The runner calls `fill(rows, drafts)` once per step, `accept(rows, tokens)` after sampling, `fill_next(rows, drafts)`
while proposing DSpark drafts and `finish(seq_ids)` at the end; a row carries its `seq_id` and `params`
(SamplingParams). Each sequence has its own matcher (the n samples of a request share the compiled grammar, through
the cache). A sequence whose constraint fails (invalid, past the compile
time limit, or a sampled token the grammar refuses) gets an open row for the rest of the step and is reported by the
next `accept` with its message: the engine fails that request alone (finish_reason "error"). A sequence whose
grammar is complete is reported with None: it stops there (finish_reason "stop"), ignore_eos or not. The manager,
and xgrammar with it, is built on the first constrained row, so unconstrained runs never import it.

The scheduler asks `is_ready` before admitting a waiting sequence, so a grammar still compiling holds back its own
request and no other; when nothing else can run, the engine blocks in `wait_ready`. Threads: `is_ready` runs on the
scheduler's thread for waiting sequences, fill / accept / fill_next / finish on the runner's for running ones, so no
sequence is moved between the manager's states by two threads at once.

With drafts, a request's verification samples 1 + len(drafts) positions, each under the mask of the grammar after the
drafts before it (the matcher accepts them to fill the rows, then rolls them back); `accept` then advances it by the
tokens the verification kept. Drafts are proposed under the grammar's masks too, and never past its end, so the
stop token is always the last token of a step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.structured_outputs.params import StructuredOutputError

if TYPE_CHECKING:
    from deepinfer.structured_outputs.manager import StructuredOutputManager


class StructuredOutputConstraint:
    """fill / accept / finish for the model runner. `manager` is a `StructuredOutputManager` or a function making
    one on first use. `submit` early (when a request is added) to compile off the critical path; otherwise the
    first `fill` of a sequence compiles it, waiting up to the time limit."""

    def __init__(self, manager: StructuredOutputManager | Callable[[], StructuredOutputManager]) -> None:
        self._manager = manager if hasattr(manager, "fill_bitmask") else None
        self._make_manager = None if self._manager is not None else manager
        self._errors: dict[Hashable, str] = {}  # failed sequences; "" once reported

    @property
    def manager(self) -> StructuredOutputManager:
        if self._manager is None:
            self._manager = self._make_manager()
        return self._manager

    def submit(self, seq_id: Hashable, params: Any) -> None:
        """Start compiling a sequence's constraint (params: its SamplingParams); a no-op for unconstrained ones."""
        constraint = params.structured_outputs
        if constraint is not None and seq_id not in self._errors and not self.manager.has_request(seq_id):
            self.manager.add_request(seq_id, constraint)

    def is_ready(self, seq_id: Hashable) -> bool:
        """Whether the sequence may be scheduled; never blocks. False only while its grammar compiles within the time
        limit: True for unconstrained sequences, and for failed ones too, so that their request fails at once."""
        return self._manager is None or self._poll(seq_id, wait=False) is not False

    def wait_ready(self, timeout: float) -> bool:
        """Block until a compiling grammar is done or past its time limit, or `timeout` s; False when none is
        compiling (nothing to wait for). The engine calls it when every unfinished sequence waits for one."""
        if self._manager is None:
            return False
        if any(self._poll(seq_id, wait=False) is not False for seq_id in self.manager.pending()):
            return True  # done since last asked: schedule it now
        return self.manager.wait_pending(timeout)

    def constrains(self, row: Any) -> bool:
        """Whether the row has a structured output (a failed one too: its request fails at its next `accept`)."""
        return row.params.structured_outputs is not None

    def fill(self, rows: Sequence[Any], drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor | None:
        """int32 bitmask for the positions about to be sampled, None if no row is constrained: 1 + len(drafts[i])
        rows for row i (after its last token, then after each draft in turn; see TokenConstraint)."""
        if all(row.params.structured_outputs is None for row in rows):
            return None  # nothing to fill: and the manager's fill threads, which compete with the forward, stay idle
        mask = self.manager.fill_bitmask(self._ids(rows), drafts)
        return None if mask is None else mask.bitmask

    def fill_next(self, rows: Sequence[Any], drafts: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """int32 bitmask, one row per row: the tokens allowed after its accepted tokens and `drafts[i]`; a row
        allowing nothing where those drafts end or break the constraint. None if no row is constrained."""
        if all(row.params.structured_outputs is None for row in rows):
            return None
        mask = self.manager.fill_next_bitmask(self._ids(rows), drafts)
        return None if mask is None else mask.bitmask

    def _ids(self, rows: Sequence[Any]) -> list[Hashable | None]:
        """Each row's matcher id: its seq_id once its grammar is compiled (waiting for it), None without one."""
        ids = []
        for row in rows:
            self.submit(row.seq_id, row.params)
            ids.append(row.seq_id if self._poll(row.seq_id, wait=True) else None)
        return ids

    def accept(self, rows: Sequence[Any], tokens: Sequence[Sequence[int]]) -> dict[Hashable, str | None]:
        """Advance each constrained sequence by its tokens of the step, in order. Returns the sequences this ends:
        {seq_id: None} when the grammar is complete, {seq_id: message} when the constraint failed."""
        ended: dict[Hashable, str | None] = {}
        for row, row_tokens in zip(rows, tokens, strict=True):
            seq_id = row.seq_id
            live = self._manager is not None and seq_id not in self._errors and self.manager.has_request(seq_id)
            # A row scheduled ahead of a sequence that has just completed is dropped by the engine: skip it here.
            for j, token in enumerate(row_tokens if live else ()):
                if self.manager.is_terminated(seq_id):
                    break
                if not self.manager.accept(seq_id, token):
                    self._fail(seq_id, self._refusal(row, token, j))
                    break
                if self.manager.is_terminated(seq_id):
                    ended[seq_id] = None
            if self._errors.get(seq_id):
                ended[seq_id], self._errors[seq_id] = self._errors[seq_id], ""  # reported once
        return ended

    def _refusal(self, row: Any, token: int, j: int) -> str:
        """Why the j-th token of `row` this step was refused (diagnose.py): the constraint cannot be met, or not."""
        from deepinfer.structured_outputs.diagnose import refusal_message

        num_outputs = len(getattr(row, "output_token_ids", ())) + getattr(row, "num_pending", 0) + j
        return refusal_message(self.manager.matcher(row.seq_id), token, row.params, num_outputs,
                               self.manager.vocab_size, self.manager.eos_token_ids)

    def finish(self, seq_ids: Sequence[Hashable]) -> None:
        """Forget sequences that will not be sampled again."""
        for seq_id in seq_ids:
            if self._manager is not None:
                self._manager.remove_request(seq_id)
            self._errors.pop(seq_id, None)

    def _poll(self, seq_id: Hashable, wait: bool) -> bool | None:
        """True: compiled; False: compiling (never with `wait`); None: no grammar (unconstrained, or failed)."""
        if seq_id in self._errors or not self.manager.has_request(seq_id):
            return None
        try:
            return self.manager.is_ready(seq_id, wait=wait)
        except StructuredOutputError as e:
            self._fail(seq_id, str(e))
            return None

    def _fail(self, seq_id: Hashable, message: str) -> None:
        self._errors[seq_id] = message
        self.manager.remove_request(seq_id)
