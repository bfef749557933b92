"""The model runner: the device side of a step. Inputs in, forward, allowed-token masks, sampling, tokens out.

It owns what lives on the device: the cache pools, each running sequence's `SequenceState`, and the tokens the last
step sampled. A step's inputs may hold PLACEHOLDER tokens (asynchronous scheduling fed the step before its outputs
were seen on the CPU); they are the tokens the previous step sampled for those sequences, taken here. Sampling is
per row with the seeded, stateless sampler, so a row's token depends on its logits, seed and position only.

Structured outputs hook in through a `TokenConstraint` (see below), called on the device side in step order, so a
grammar matcher always sees the tokens of the step before, asynchronous scheduling or not.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Protocol

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.engine.speculative import Drafter, Proposal, step_picks, verify
from deepinfer.outputs import Logprob
from deepinfer.sampler import as_allowed
from deepinfer.sampling_params import SamplingParams
from dsl.cache import PagedCache
from dsl.context import SequenceState
from graphs.compiled_model import RunnableModel

logger = logging.getLogger(__name__)


@dataclass
class SampleRow:
    """What sampling one row needs. `output_token_ids` are the outputs seen on the CPU when the step was scheduled;
    the one the previous step sampled follows them when `num_pending` is 1."""

    seq_id: int
    request_id: str
    index: int
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_pending: int


@dataclass
class RowInput:
    """One sequence's chunk: tokens from position `start`, in its `slot` with its `block_table`; the last
    `num_drafts` of them are drafts to verify (speculative decoding)."""

    seq_id: int
    slot: int
    block_table: list[int]
    start: int
    token_ids: list[int]
    sample: SampleRow | None
    num_drafts: int = 0


@dataclass
class StepInput:
    rows: list[RowInput]
    freed: list[int]  # sequences whose caches were released (finished or preempted): forget their state
    finished: list[int]  # sequences done for good, among `freed`


@dataclass
class StepOutput:
    """Per sampled row, in order: its tokens (one, or with drafts the accepted ones and the target's next) and,
    when asked for, their log-probabilities; `error` if the step failed; `ended`: sequences the token constraint
    ends (see TokenConstraint.accept); `proposals`: the next drafts of each drafting sequence, by seq_id."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob] | None]]
    error: str | None = None
    ended: dict[int, str | None] = field(default_factory=dict)
    proposals: dict[int, Proposal] = field(default_factory=dict)


class TokenConstraint(Protocol):
    """Per-sequence allowed tokens (structured outputs). The runner calls, in step order on one thread:
    `fill(rows, drafts)` once per step after launching the forward: a mask for the positions about to be sampled,
    1 + len(drafts[i]) rows for row i (the position after its last token, then after each of its drafts in turn),
    bool [positions, vocab] (True = allowed) or a packed int32 bitmask [positions, ceil(vocab / 32)] (bit v % 32 of
    word v // 32), or None when no row is constrained; each mask row a sequence can reach must allow a token.
    `accept(rows, tokens)` after sampling, with each row's tokens of the step in order; it returns the sequences
    the constraint ends, by seq_id (or None for none): None when the constraint is complete (the sequence stops
    there, finish_reason "stop"), or a message when it failed (the request fails alone, finish_reason "error").
    `fill_next(rows, drafts)` while proposing drafts: one mask row per row, the tokens allowed after its accepted
    tokens followed by `drafts[i]`; a row allowing nothing says those drafts end or break the constraint (drafting
    stops there and the last draft is dropped). `finish(seq_ids)` for sequences that will not be sampled again."""

    def fill(self, rows: list[SampleRow], drafts: list[list[int]]) -> torch.Tensor | None: ...

    def accept(self, rows: list[SampleRow], tokens: list[list[int]]) -> dict[int, str | None] | None: ...

    def fill_next(self, rows: list[SampleRow], drafts: list[list[int]]) -> torch.Tensor | None: ...

    def finish(self, seq_ids: list[int]) -> None: ...


class ModelRunner:
    def __init__(self, compiled: RunnableModel[DeepseekV41Config], cache: PagedCache, eos_token_ids: tuple[int, ...],
                 batch_invariant: bool, constraint: TokenConstraint | None = None, overlap_constraint: bool = True,
                 drafter: Drafter | None = None) -> None:
        self.compiled, self.cache, self.eos_token_ids = compiled, cache, eos_token_ids
        self.batch_invariant = batch_invariant
        self.constraint = constraint
        self.drafter = drafter
        # One thread fills the masks while the forward runs; one, so fills stay in step order.
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="mask-fill") if constraint and overlap_constraint \
            else None
        self.states: dict[int, SequenceState] = {}
        self.last_sampled: dict[int, int] = {}
        self.draft_lengths: dict[int, int] = {}  # each drafting sequence's draft block this step
        self.failed: set[int] = set()  # sequences of a failed step: skipped until the CPU side frees them

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step. A failure comes back as `error`; its sequences are skipped from then on (their rows get
        token 0), so the steps already scheduled behind it still run for the others."""
        for seq_id in step.freed:
            self.states.pop(seq_id, None)
            self.last_sampled.pop(seq_id, None)
            self.draft_lengths.pop(seq_id, None)
            self.failed.discard(seq_id)
        if self.constraint is not None and step.finished:
            self.constraint.finish(step.finished)
        rows = [row for row in step.rows if row.seq_id not in self.failed]
        out = StepOutput([], [])
        try:
            tokens = self._execute(rows, out.ended, out.proposals)
        except Exception as e:  # a failing step fails its requests, not the engine
            logger.exception("a step of %d sequences failed", len(rows))
            self.failed.update(row.seq_id for row in rows)
            tokens, out.error = {}, f"{type(e).__name__}: {e}"
        for row in step.rows:
            if row.sample is not None:
                token_ids, logprobs = tokens.get(row.seq_id, ([0], [None]))
                self.last_sampled[row.seq_id] = token_ids[-1]
                out.token_ids.append(token_ids)
                out.logprobs.append(logprobs)
        return out

    def _execute(self, rows: list[RowInput], ended: dict[int, str | None],
                 proposals: dict[int, Proposal]) -> dict[int, tuple[list[int], list[dict | None]]]:
        """Forward and sample; (tokens, logprobs) per sampled sequence. The constraint's verdicts go to `ended`,
        the drafter's next drafts to `proposals`."""
        if not rows:
            return {}
        batch = [(self._state(row), self._resolve(row)) for row in rows]
        sampled = [(i, row) for i, row in enumerate(rows) if row.sample is not None]
        samples = [row.sample for _, row in sampled]
        drafts = [row.token_ids[len(row.token_ids) - row.num_drafts:] for _, row in sampled]
        fill = (lambda: self.constraint.fill(samples, drafts)) if self.constraint and sampled else (lambda: None)
        # The overlap: the masks are filled while the forward runs.
        pending = self._filler.submit(fill) if self._filler is not None else None
        # Asked only when wanted: a target without batch-invariant kernels then refuses, rather than run without.
        kwargs = {"batch_invariant": True} if self.batch_invariant else {}
        num_logits = [1 + row.num_drafts for row in rows]
        if self.drafter is not None:
            kwargs["num_logits"] = num_logits
        logits = self.compiled.step(batch, **kwargs)
        allowed = as_allowed(pending.result() if pending is not None else fill(), logits.shape[-1])
        first = list(accumulate(num_logits, initial=0))  # each row's first logits row
        mask_first = list(accumulate((1 + len(d) for d in drafts), initial=0))  # each sampled row's first mask row
        outputs = [row.sample.output_token_ids + ([self.last_sampled[row.seq_id]] if row.sample.num_pending else [])
                   for _, row in sampled]
        # plain greedy and plain sampled rows: every row's token read back once for the step (on a GPU target drawn by
        # the sampling kernel's cubins)
        with self.compiled.sampling():
            picks = None if allowed is not None else step_picks(
                logits, [(row.sample, o, range(first[i], first[i] + 1 + row.num_drafts))
                         for (i, row), o in zip(sampled, outputs, strict=True)])
        out, drafting, lengths = {}, [], []
        for j, (i, row) in enumerate(sampled):
            s = row.sample
            rows_of = slice(first[i], first[i] + 1 + row.num_drafts)
            row_allowed = None if allowed is None else allowed[mask_first[j]: mask_first[j + 1]]
            out[row.seq_id] = verify(logits[rows_of], row_allowed, s, outputs[j], drafts[j], self.eos_token_ids,
                                     None if picks is None else picks[rows_of])
            if row.num_drafts:
                num_kept = row.start + len(out[row.seq_id][0])
                self.compiled.rollback(batch[i][0], num_kept, self.drafter.config.num_speculative_tokens)
            if self.drafter is not None:
                drafting.append((batch[i][0], s, outputs[j] + out[row.seq_id][0]))
                length = self.drafter.config.next_length(self.draft_lengths.get(row.seq_id), row.num_drafts,
                                                         len(out[row.seq_id][0]) - 1)
                self.draft_lengths[row.seq_id] = length
                lengths.append(length)
        if self.constraint is not None and sampled:
            ended.update(self.constraint.accept(samples, [out[row.seq_id][0] for _, row in sampled]) or {})
        if drafting:
            fill_next = self.constraint.fill_next if self.constraint is not None else None
            made = self.drafter.propose(drafting, fill_next, lengths)
            proposals.update({s.seq_id: p for (_, s, _), p in zip(drafting, made, strict=True)})
        return out

    def _state(self, row: RowInput) -> SequenceState:
        """The sequence's state: fresh when it starts (or restarts after preemption) at position 0."""
        state = self.states.get(row.seq_id)
        if row.start == 0:
            state = self.states[row.seq_id] = SequenceState(cache=self.cache, slot=row.slot)
        elif state is None or state.num_tokens != row.start:
            raise RuntimeError(f"sequence {row.seq_id} continues at token {row.start} but its cache holds "
                               f"{None if state is None else state.num_tokens}")
        state.slot, state.block_table = row.slot, row.block_table
        return state

    def _resolve(self, row: RowInput) -> list[int]:
        return [self.last_sampled[row.seq_id] if t < 0 else t for t in row.token_ids]

