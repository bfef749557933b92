"""The model runner: the device side of a step. Inputs in, forward, allowed-token masks, sampling, tokens out.

It owns what lives on the device: the cache pools, each running sequence's `SequenceState`, and the tokens the last
step sampled. A step's inputs may hold PLACEHOLDER tokens (asynchronous scheduling fed the step before its outputs
were seen on the CPU); they are the tokens the previous step sampled for those sequences, taken here. The sampler
(deepinfer/engine/sampler.py) draws each sampled row's token with the seeded, stateless sampler, so a row's token
depends on its logits, seed and position only. A token constraint (deepinfer/engine/token_constraint.py) fills its
masks while the forward runs; a speculator (deepinfer/engine/speculator.py) samples in the sampler's place and
proposes the next drafts.

A *plain* step (no speculator, no row the constraint constrains, every sampled row drawn by `sample_plain`:
`Sampler.is_plain`) does not wait for its tokens: `execute` returns once the forward and the draw are queued on the
device (a static step draws inside its graph: `dsl.context.Draws`), with the tokens to come (`StepOutput.result`
reads them), and the next step's placeholders take them on the device (`CompiledModel.step`'s `fed`). So with
asynchronous scheduling the host prepares step n + 1 while the device runs step n. A step that needs a placeholder's
value on the host (a row whose sampling reads its outputs) waits for it first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.engine.sampler import Draw, SampledIds, Sampler, SampleRow, Tokens
from deepinfer.engine.sequence import PLACEHOLDER
from deepinfer.engine.speculator import Proposal, Speculator
from deepinfer.engine.token_constraint import TokenConstraint
from deepinfer.outputs import Logprob
from deepinfer.sampler import as_allowed, plain_args
from dsl.cache import PagedCache
from dsl.context import Draws, SequenceState
from graphs.compiled_model import RunnableModel
from graphs.runtime import FatalRuntimeError

logger = logging.getLogger(__name__)


@dataclass
class RowInput:
    """One sequence's chunk: tokens from position `start`, in its `slot` with its `block_table`; the last
    `num_drafts` of them are drafts to verify (speculative decoding). Prefix caching: `restore` is the snapshot slot
    the sequence resumes from at `start`; `snapshot` (position, snapshot slot) asks for the slot to be copied there
    after the step, if the sequence kept every token up to the position. `replay_from`: in bounded replay, the first
    position the decoder layers run at (`SequenceState.replay_from`)."""

    seq_id: int
    slot: int
    block_table: list[int]
    start: int
    token_ids: list[int]
    sample: SampleRow | None
    num_drafts: int = 0
    restore: int | None = None
    snapshot: tuple[int, int] | None = None
    replay_from: int = 0


@dataclass
class StepInput:
    rows: list[RowInput]
    freed: list[int]  # sequences whose caches were released (finished or preempted): forget their state
    finished: list[int]  # sequences done for good, among `freed`


@dataclass
class StepOutput:
    """Per sampled row, in order: its tokens (one, or with drafts the accepted ones and the target's next) and,
    when asked for, their log-probabilities; `error` if the step failed; `ended`: sequences the token constraint
    ends (see TokenConstraint.accept); `proposals`: the next drafts of each drafting sequence, by seq_id;
    `snapshots`: the sequences whose asked-for snapshot was taken. A plain step's tokens come from the device:
    `result()` fills `token_ids` (waiting for them) before they are read."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, Logprob] | None]]
    error: str | None = None
    ended: dict[int, str | None] = field(default_factory=dict)
    proposals: dict[int, Proposal] = field(default_factory=dict)
    snapshots: set[int] = field(default_factory=set)
    pending: Callable[[StepOutput], None] | None = None

    def result(self) -> StepOutput:
        """This output with every token filled in: a plain step's read from the device once (waiting for them)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending(self)
        return self


class ModelRunner:
    def __init__(self, compiled: RunnableModel[DeepseekV41Config], cache: PagedCache, eos_token_ids: tuple[int, ...], batch_invariant: bool,
                 constraint: TokenConstraint | None = None, overlap_constraint: bool = True,
                 speculator: Speculator | None = None) -> None:
        self.compiled, self.cache = compiled, cache
        self.batch_invariant = batch_invariant
        self.constraint, self.speculator = constraint, speculator
        self.sampler = Sampler(eos_token_ids)
        # One thread fills the masks while the forward runs; one, so fills stay in step order.
        overlap = constraint is not None and overlap_constraint
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="mask-fill") if overlap else None
        self.states: dict[int, SequenceState] = {}
        # each sequence's last sampled token: on the host, or (a plain step's tokens, its row) on the device
        self.last_sampled: dict[int, int | tuple[SampledIds, int]] = {}
        self.failed: set[int] = set()  # sequences of a failed step: skipped until the CPU side frees them

    def execute(self, step: StepInput) -> StepOutput:
        """Run one step. A failure comes back as `error`; its sequences are skipped from then on (their rows get
        token 0), so the steps already scheduled behind it still run for the others."""
        self._forget(step)
        rows = [row for row in step.rows if row.seq_id not in self.failed]
        out = StepOutput([], [])
        try:
            tokens = self._execute(rows, out)
        except FatalRuntimeError:
            raise  # no step can run after it (a rank of several is gone): the engine stops
        except Exception as e:  # a failing step fails its requests, not the engine
            logger.exception("a step of %d sequences failed", len(rows))
            self.failed.update(row.seq_id for row in rows)
            tokens, out.error = {}, f"{type(e).__name__}: {e}"
        sampled = [row for row in step.rows if row.sample is not None]
        if isinstance(tokens, tuple):  # a plain step's tokens, still on the device: (their ids, each sequence's row)
            ids, at = tokens
            where = [at.get(row.seq_id) for row in sampled]
            for row, i in zip(sampled, where, strict=True):
                self.last_sampled[row.seq_id] = 0 if i is None else (ids, i)
            out.pending = lambda out: self._read(out, ids, where)
            return out
        for row in sampled:
            token_ids, logprobs = tokens.get(row.seq_id, ([0], [None]))
            self.last_sampled[row.seq_id] = token_ids[-1]
            out.token_ids.append(token_ids)
            out.logprobs.append(logprobs)
        return out

    def _read(self, out: StepOutput, ids: SampledIds, at: list[int | None]) -> None:
        """A plain step's tokens into `out`, read from the device: the sampled rows' in order (None: a row of a
        failed sequence, token 0)."""
        try:
            host = ids.tolist()
        except Exception as e:  # the device failed the step after it was queued
            logger.exception("reading a step's tokens failed")
            out.error, host = f"{type(e).__name__}: {e}", None
        for i in at:
            out.token_ids.append([host[i] if host is not None and i is not None else 0])
            out.logprobs.append([None])

    def _forget(self, step: StepInput) -> None:
        """Drop the state of the sequences the CPU side released; tell the constraint which are done for good."""
        for seq_id in step.freed:
            self.states.pop(seq_id, None)
            self.last_sampled.pop(seq_id, None)
            self.failed.discard(seq_id)
        if self.speculator is not None and step.freed:
            self.speculator.forget(step.freed)
        if self.constraint is not None and step.finished:
            self.constraint.finish(step.finished)

    def _execute(self, rows: list[RowInput], out: StepOutput) -> dict[int, Tokens] | tuple[SampledIds, dict[int, int]]:
        """Forward and sample; the tokens of each sampled sequence, by seq_id, or for a plain step the tokens on the
        device and each sampled sequence's row in them. The constraint's verdicts go to `out.ended`, the
        speculator's proposals to `out.proposals`."""
        if not rows:
            return {}
        plain = self._plain(rows)
        fed: list[tuple[int, SampledIds, int]] = []  # (flat input row, the tokens it takes, their row)
        batch, first = [], 0
        for row in rows:
            batch.append((self._state(row), self._resolve(row, first, fed if plain else None)))
            first += len(row.token_ids)
        draws = self._draws(rows, batch)
        if plain:  # the tokens drawn inside the step's graph where it can, else from its logits
            temperatures, seeds, _ = self.sampler.plain_rows(len(rows), draws, [True] * len(draws))
            inside = Draws(*plain_args(temperatures, seeds))
            logits = self._forward(batch, rows, fed, inside)
            if inside.tokens is not None:
                ids = SampledIds(inside.tokens)
            else:
                with self.compiled.sampling():
                    ids = self.sampler.draw(logits, draws)
            self._snapshots(rows, batch, out)
            return ids, {d.row.seq_id: d.first for d in draws}
        masks = self._masks(draws)  # filling while the forward runs, when a filler thread is on
        logits = self._forward(batch, rows)
        allowed = as_allowed(masks(), logits.shape[-1])
        with self.compiled.sampling():
            sampled = (self.speculator.verify if self.speculator is not None else self.sampler)(logits, allowed, draws)
        tokens = [t for t, _ in sampled]
        if self.constraint is not None and draws:
            out.ended.update(self.constraint.accept([d.row for d in draws], tokens) or {})
        if self.speculator is not None:
            out.proposals.update(self.speculator.propose(draws, tokens, self.constraint))
        self._snapshots(rows, batch, out)
        return {d.row.seq_id: s for d, s in zip(draws, sampled, strict=True)}

    def _snapshots(self, rows: list[RowInput], batch: list[tuple[SequenceState, list[int]]], out: StepOutput) -> None:
        """Copy the slots asked for into their snapshot slots, where the sequence kept every token up to the
        position (rejected drafts may end it before): the rings then still hold that position's windows, as a
        step's tokens past it are at most the rings' spare positions."""
        for row, (state, _) in zip(rows, batch, strict=True):
            if row.snapshot is not None and state.num_tokens >= row.snapshot[0]:
                self.cache.copy_slot(row.slot, row.snapshot[1])
                out.snapshots.add(row.seq_id)

    def _draws(self, rows: list[RowInput], batch: list[tuple[SequenceState, list[int]]]) -> list[Draw]:
        """The sampled rows of the step, with their outputs so far and where their logits rows start."""
        draws, first = [], 0
        for row, (state, tokens) in zip(rows, batch, strict=True):
            s = row.sample
            if s is not None:
                # the token the step before sampled is this step's last input before the drafts (PLACEHOLDER where a
                # plain step takes it on the device: only the outputs' count is read then)
                pending = tokens[len(tokens) - row.num_drafts - 1]
                outputs = s.output_token_ids.then(pending) if s.num_pending else s.output_token_ids
                draws.append(Draw(s, outputs, row.token_ids[len(row.token_ids) - row.num_drafts:], first, state))
            first += 1 + row.num_drafts
        return draws

    def _plain(self, rows: list[RowInput]) -> bool:
        """Whether the step is plain (see the module's docstring): its tokens can stay on the device."""
        if self.speculator is not None:
            return False
        vocab = self.compiled.config.vocab_size
        samples = [r.sample for r in rows if r.sample is not None]
        if self.constraint is not None and any(self.constraint.constrains(s) for s in samples):
            return False
        return all(self.sampler.is_plain(s.params, len(s.output_token_ids) + s.num_pending, vocab) for s in samples)

    def _masks(self, draws: list[Draw]) -> Callable[[], torch.Tensor | None]:
        """The constraint's masks of the draws' positions, to call for after the forward: on the filler thread they
        are filled meanwhile, otherwise when called."""
        if self.constraint is None or not draws:
            return lambda: None
        rows, drafts = [d.row for d in draws], [d.drafts for d in draws]
        if self._filler is None:
            return lambda: self.constraint.fill(rows, drafts)
        return self._filler.submit(self.constraint.fill, rows, drafts).result

    def _forward(self, batch: list[tuple[SequenceState, list[int]]], rows: list[RowInput],
                 fed: list[tuple[int, SampledIds, int]] = (), draws: Draws | None = None) -> torch.Tensor:
        """The step's logits: after each row's last token and each of its drafts. `fed`: the inputs that take an
        earlier step's tokens on the device, (flat row, those tokens, their row), all of one step; `draws`: the
        tokens to draw inside the step's graph where it can (a plain step without drafts)."""
        num_logits = [1 + row.num_drafts for row in rows] if self.speculator is not None else None
        feed = (fed[0][1].ids, [f[0] for f in fed], [f[2] for f in fed]) if fed else None
        return self.compiled.step(batch, batch_invariant=self.batch_invariant, num_logits=num_logits, fed=feed,
                                  draws=draws)

    def _state(self, row: RowInput) -> SequenceState:
        """The sequence's state: fresh when it starts (or restarts after preemption) at position 0, or from the
        snapshot it resumes from."""
        state = self.states.get(row.seq_id)
        if row.restore is not None:
            self.cache.copy_slot(row.restore, row.slot)
            state = self.states[row.seq_id] = SequenceState(row.start, cache=self.cache, slot=row.slot)
        elif row.start == 0:
            state = self.states[row.seq_id] = SequenceState(cache=self.cache, slot=row.slot)
        elif state is None or state.num_tokens != row.start:
            raise RuntimeError(f"sequence {row.seq_id} continues at token {row.start} but its cache holds "
                               f"{None if state is None else state.num_tokens}")
        state.slot, state.block_table, state.replay_from = row.slot, row.block_table, row.replay_from
        return state

    def _resolve(self, row: RowInput, first: int, fed: list[tuple[int, SampledIds, int]] | None) -> list[int]:
        """The row's tokens with each placeholder's value: the token its sequence last sampled, on the host if it is
        there or `fed` is None (then waiting for it), else PLACEHOLDER, and (`first` + its index, the tokens, their
        row) added to `fed`, the device then feeding it. Every fed placeholder takes the tokens of one step."""
        if PLACEHOLDER not in row.token_ids:
            return row.token_ids
        out = list(row.token_ids)
        for i, t in enumerate(out):
            if t != PLACEHOLDER:
                continue
            last = self.last_sampled[row.seq_id]
            if isinstance(last, int):
                out[i] = last
            elif fed is None or last[0].ready() or (fed and fed[0][1] is not last[0]):
                out[i] = last[0].tolist()[last[1]]
            else:
                fed.append((first + i, *last))
        return out

