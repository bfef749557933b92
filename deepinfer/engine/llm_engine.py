"""The engine: requests in, the scheduler and the model runner in a loop, finished requests out.

The model runner works on the calling thread, where torch's thread pool is (on the cpu, small GEMMs called from a
second thread pay for waking that thread's own OpenMP team: bench/RESULTS.md). With `async_scheduling` a helper thread
does the CPU's share meanwhile: while step n runs, it takes step n - 1's tokens (detokenizing, stop strings,
finishing) and schedules step n + 1, whose inputs name the tokens step n is sampling as placeholders. A sequence
that stops at step n was already scheduled in step n + 1: that row is computed and dropped. A plain step's tokens
stay on the device (deepinfer/engine/model_runner.py), so step n + 1 is queued behind step n before step n's tokens
reach the host: the device runs one step after another while the host works. Without it, each step is scheduled,
run and processed in turn on the calling thread.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import count

from deepinfer import logits_processors
from deepinfer.config import DeepseekV41Config
from deepinfer.cpu_threads import cpu_threads
from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.engine_args import EngineArgs
from deepinfer.engine.memory import plan_caches
from deepinfer.engine.model_runner import ModelRunner, RowInput, StepInput, StepOutput
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.prefix_cache import PrefixCache
from deepinfer.engine.request import Request, RequestError, check_prompt
from deepinfer.engine.sampler import SampleRow
from deepinfer.engine.scheduler import ScheduledChunk, Scheduler
from deepinfer.engine.sequence import Outputs, SequenceStatus
from deepinfer.engine.speculator import Speculator
from deepinfer.engine.token_constraint import TokenConstraint
from deepinfer.inputs import PromptType, parse_prompt
from deepinfer.outputs import RequestMetrics, RequestOutput
from deepinfer.replay import check_replay_tokens, replay_from
from deepinfer.sampling_params import SamplingParams
from dsl.cache import CacheSpec, PagedCache
from graphs.compiled_model import RunnableModel

logger = logging.getLogger(__name__)


class LLMEngine:
    """Runs requests on a compiled model. `add_request` queues one; `run()` yields outputs as requests finish.
    `constraint`: the token constraint (None: none); `speculator`: speculative decoding (None: off)."""

    def __init__(self, compiled: RunnableModel[DeepseekV41Config], tokenizer, args: EngineArgs,
                 eos_token_ids: tuple[int, ...], constraint: TokenConstraint | None = None,
                 speculator: Speculator | None = None) -> None:
        self.args, self.config = args, compiled.config
        self.constraint, self.speculator = constraint, speculator
        if speculator is not None and args.async_scheduling:
            logger.info("speculative decoding schedules each step after the last one's tokens are seen: "
                        "async_scheduling is off")
        num_drafts = speculator.num_speculative_tokens if speculator is not None else 0
        check_replay_tokens(self.config, args.swa_replay_tokens, num_drafts)
        if args.swa_replay_tokens is not None and not any(n.op == "decoder_context" for n in compiled.graph.nodes):
            raise ValueError("swa_replay_tokens needs a model compiled for bounded replay: "
                             "deepinfer.compile(model, replay=True)")
        # Rejected drafts are taken back: every ring keeps that many more positions.
        spec = CacheSpec.from_graph(compiled.graph, spare=num_drafts)
        self.layout, self.max_model_len = plan_caches(spec, args, self.config.max_position_embeddings,
                                                      compiled.device)
        # prefix caching's snapshot slots follow the running sequences' slots in the pools
        cache = PagedCache(spec, self.layout.num_slots + self.layout.num_snapshots, self.layout.num_blocks,
                           self.layout.block_size, compiled.device)
        # a sequence whose constraint is still being prepared waits, and holds back no other
        ready = (lambda seq: constraint.is_ready(seq.seq_id)) if constraint is not None else None
        blocks = BlockManager(self.layout, args.enable_prefix_caching, args.swa_replay_tokens)
        self.scheduler = Scheduler(blocks, args.max_num_seqs, args.max_num_batched_tokens, speculator, ready=ready)
        self.runner = ModelRunner(compiled, cache, eos_token_ids, args.batch_invariant, constraint,
                                  overlap_constraint=args.overlap_structured_outputs, speculator=speculator)
        # GPU targets: every decode step's bucket captured at the first capture
        compiled.capture_ahead(args.max_num_seqs * (1 + num_drafts))
        self.output_processor = OutputProcessor(tokenizer, eos_token_ids)
        self.tokenizer = tokenizer
        self.requests: dict[str, Request] = {}
        self._done: list[Request] = []
        self._finished_seqs: list[int] = []
        self._seeds = random.Random(args.seed)
        self._ids = count()
        self.num_steps = 0
        self.threads: int | None = None  # torch's thread count while running (the cpu target's choice), else as is

    def draw_seed(self, params: object) -> int:
        """The seed of a request with these params: its own, else the next of the engine's draws (`args.seed`)."""
        own = params.seed if isinstance(params, SamplingParams) else None
        return own if own is not None else self._seeds.getrandbits(63)

    def add_request(self, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None,
                    seed: int | None = None) -> str:
        """Queue a request; returns its id. A request that cannot run (a malformed prompt, parameters that are not
        a SamplingParams, ...) finishes at once with its error; nothing of it is queued. `seed`: one drawn by
        `draw_seed` already (several ranks draw every request's seed, then each queues its share)."""
        request_id = str(next(self._ids))
        metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        # Seeds are drawn at submission, in order, so they do not depend on how requests are batched or fail.
        seed = self.draw_seed(params) if seed is None else seed
        if not isinstance(params, SamplingParams):
            params, error = SamplingParams(), f"sampling params must be a SamplingParams, got {type(params).__name__}"
        else:
            error = None
        request = Request(request_id, prompt if isinstance(prompt, str) else None, [], params, seed, metrics)
        self.requests[request_id] = request
        try:
            if error is not None:
                raise RequestError(error)
            request.prompt, request.prompt_token_ids = parse_prompt(self.tokenizer, prompt)
            check_prompt(request.prompt_token_ids, self.config.vocab_size, self.max_model_len)
            logits_processors.resolve(params, self.tokenizer, self.config.vocab_size)
            if self.args.swa_replay_tokens is not None and params.prompt_logprobs is not None:
                raise RequestError(f"prompt_logprobs are not computed with swa_replay_tokens="
                                   f"{self.args.swa_replay_tokens}: bounded replay skips the decoder layers over the "
                                   "prompt's earlier tokens; leave swa_replay_tokens None to have them")
            seqs = request.make_sequences(self.max_model_len)
        except ValueError as e:  # RequestError and the params' own checks against this model
            logger.warning("request %s failed: %s", request_id, e)
            self._fail(request, str(e))
            return request_id
        # The constraint starts now (structured outputs compile their grammar), while the steps before this
        # request's first sample run, rather than on its first fill.
        for seq in seqs:
            self.scheduler.add(seq)
            if self.constraint is not None:
                self.constraint.submit(seq.seq_id, params)
        return request_id

    def run(self) -> Iterator[RequestOutput]:
        """Run until every queued request is finished, yielding each one's output when it finishes."""
        with cpu_threads(self.threads), ThreadPoolExecutor(1, thread_name_prefix="deepinfer-scheduler") as helper:
            last: tuple[list[ScheduledChunk], StepOutput] | None = None  # a step whose tokens are not taken yet
            chunks = self._schedule()
            while True:
                yield from self._pop_done()
                if not chunks:
                    if last is not None:
                        self._postprocess(*last)
                        last, chunks = None, self._schedule()
                        continue
                    if self.scheduler.has_unfinished and self._wait_ready():
                        chunks = self._schedule()  # every waiting sequence is held back for its constraint
                        continue
                    if self.scheduler.has_unfinished:
                        raise RuntimeError(f"the scheduler can run nothing: {self.scheduler.running} running, "
                                           f"{list(self.scheduler.waiting)} waiting")
                    self.runner.execute(self._step_input([]))  # hand the last finished sequences to the runner
                    return
                step = self._step_input(chunks)
                if self.args.async_scheduling and self.speculator is None:
                    cpu = helper.submit(self._process_and_schedule, last)
                    last = (chunks, self.runner.execute(step))
                    chunks = cpu.result()
                else:
                    self._postprocess(chunks, self.runner.execute(step))
                    chunks = self._schedule()

    def _wait_ready(self) -> bool:
        """Wait up to a second for a sequence the constraint holds back; False when it holds none back."""
        return self.constraint is not None and self.constraint.wait_ready(1.0)

    def _schedule(self) -> list[ScheduledChunk]:
        return self.scheduler.schedule() if self.scheduler.has_unfinished else []

    def _process_and_schedule(self, last: tuple[list[ScheduledChunk], StepOutput] | None) -> list[ScheduledChunk]:
        """The CPU's share while a step runs: the tokens of the step before it, then the step after it."""
        if last is not None:
            self._postprocess(*last)
        return self._schedule()

    def _step_input(self, chunks: list[ScheduledChunk]) -> StepInput:
        """The runner's inputs for `chunks`, with the sequences released since the last step."""
        now = time.time()
        rows = []
        for c in chunks:
            seq, request = c.seq, self.requests[c.seq.request_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            outputs = Outputs(seq.output_token_ids, len(seq.output_token_ids))  # read in place, not copied
            sample = SampleRow(seq.seq_id, seq.request_id, seq.index, seq.params, seq.seed, seq.prompt_token_ids,
                               outputs, seq.num_inflight - 1) if c.samples else None
            tokens = seq.token_ids(c.start, c.length - len(c.drafts)) + c.drafts
            rows.append(RowInput(seq.seq_id, seq.slot, list(seq.block_table), c.start, tokens, sample, len(c.drafts),
                                 c.restore, c.snapshot, self._replay_from(c)))
        step = StepInput(rows, self.scheduler.freed, self._finished_seqs)
        self.scheduler.freed, self._finished_seqs = [], []
        self.num_steps += bool(rows)
        return step

    def _replay_from(self, c: ScheduledChunk) -> int:
        """Bounded replay: the first position the decoder layers run at in every chunk of the sequence, its prompt's
        last `swa_replay_tokens` (0: off; deepinfer/replay.py). A recompute after preemption runs them from there
        too, over its outputs as well, so its decoder windows come back as they were; with prefix caching it resumes
        at the last snapshot that holds them (its own, taken as it went) or at one at or before this position. A
        decode or verification chunk lies past it: all of its rows run."""
        return replay_from(len(c.seq.prompt_token_ids), self.args.swa_replay_tokens)

    def _postprocess(self, chunks: list[ScheduledChunk], out: StepOutput) -> None:
        out = out.result()  # a plain step's tokens, read from the device (waiting for them)
        if out.error is not None:
            for c in chunks:
                if not c.seq.is_finished:
                    self._fail(self.requests[c.seq.request_id], out.error)
        now = time.time()
        for c, tokens, logprobs in zip([c for c in chunks if c.samples], out.token_ids, out.logprobs, strict=True):
            seq = c.seq
            seq.num_inflight -= 1
            if seq.is_finished:
                continue  # it stopped at the step before; this row was computed ahead and is dropped
            request = self.requests[seq.request_id]
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            seq.proposal = out.proposals.get(seq.seq_id)
            if c.drafts:
                request.metrics.count_drafts(len(c.drafts), len(tokens) - 1)
            done = False
            for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
                seq.num_computed_tokens += j > 0  # an accepted draft: its caches were computed by this step
                request.metrics.num_generated_tokens += 1
                done = self.output_processor.append(seq, token, lp)
                if done:
                    break
            if not done and seq.seq_id in out.ended:  # the token constraint ends it
                if out.ended[seq.seq_id] is not None:
                    self._fail(request, out.ended[seq.seq_id])
                    continue
                seq.finish_reason, done = "stop", True
            if done:
                self._finish_seq(seq)
        self.scheduler.cache_step(chunks, out.snapshots, failed=out.error is not None)

    def _finish_seq(self, seq) -> None:
        self.output_processor.finish(seq)
        self.scheduler.finish(seq)
        self._finished_seqs.append(seq.seq_id)
        request = self.requests[seq.request_id]
        if request.is_finished:
            self._complete(request)

    def _fail(self, request: Request, error: str) -> None:
        """Finish every sequence of `request` with finish_reason "error"."""
        if request.error is not None:
            return
        request.error = error
        for seq in request.seqs:
            if seq.status is not SequenceStatus.FINISHED:
                seq.finish_reason = "error"
                self.scheduler.finish(seq)
                self._finished_seqs.append(seq.seq_id)
        self._complete(request)

    def _complete(self, request: Request) -> None:
        request.metrics.finished_time = time.time()
        self._done.append(request)

    def _pop_done(self) -> Iterator[RequestOutput]:
        done, self._done = self._done, []
        for request in done:
            del self.requests[request.request_id]
            yield request.output()

    def abort_all(self) -> None:
        """Drop every unfinished request (finish_reason "abort"); outputs not yet taken are dropped too."""
        for request in self.requests.values():
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "abort"
                    self.scheduler.finish(seq)
                    self._finished_seqs.append(seq.seq_id)
        self.requests.clear()
        self._done = []

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache's bookkeeping and counters (`hit_rate`), None when prefix caching is off."""
        return self.scheduler.block_manager.prefix_cache
