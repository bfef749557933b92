"""The engine's one handle on structured outputs: compile per request, fill the batch's bitmask, apply it, advance.

Each step, for a batch whose rows are requests (None or unconstrained requests for the rest):

    mask = manager.fill_bitmask(request_ids)       # CPU; or fill_bitmask_async(...) before the forward, .result() after
    logits = forward(...)
    if mask is not None:                            # no constrained row in the batch: nothing to do, nothing paid
        manager.apply_bitmask(logits, mask)
    for each row: token = sample(logits[row], ...); manager.accept(request_id, token)
                  manager.is_terminated(request_id) -> finish_reason "stop"
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import xgrammar as xgr

from deepinfer.structured_outputs.bitmask import allocate_bitmask, allow_all, apply_bitmask
from deepinfer.structured_outputs.compiler import CompileFuture, GrammarCompiler
from deepinfer.structured_outputs.matcher import RequestMatcher
from deepinfer.structured_outputs.params import StructuredOutputError, StructuredOutputsParams
from deepinfer.structured_outputs.tokenizer_info import build_tokenizer_info
from deepinfer.tokenizer import Tokenizer


@dataclass
class BatchBitmask:
    """A filled bitmask for one step: int32 [num_rows, ceil(V / 32)] (a view of the manager's buffer, valid until the
    next fill; unconstrained rows allow everything) and the rows holding a constraint, the only ones applied."""

    bitmask: torch.Tensor
    rows: list[int]


class StructuredOutputManager:
    """Structured outputs for one model: `vocab_size` is its head's (the logits' width), `eos_token_ids` its stops."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *, max_num_rows: int = 256,
                 compile_timeout_s: float = 30.0, max_workers: int = 2, cache_size: int = 128) -> None:
        self.vocab_size, self.eos_token_ids = vocab_size, tuple(eos_token_ids)
        info = build_tokenizer_info(tokenizer, vocab_size, eos_token_ids)
        self.compiler = GrammarCompiler(info, max_workers=max_workers, cache_size=cache_size,
                                        timeout_s=compile_timeout_s)
        self._pending: dict[Hashable, tuple[CompileFuture, str]] = {}  # request id -> (compile future, what)
        self._matchers: dict[Hashable, RequestMatcher] = {}
        self._bitmask = allocate_bitmask(max_num_rows, vocab_size)
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=max_workers)
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bitmask-fill")

    def add_request(self, request_id: Hashable, params: StructuredOutputsParams) -> None:
        """Start compiling a request's constraint in the background; returns at once."""
        self._pending[request_id] = (self.compiler.submit(params), f"the {params.kind} constraint")

    def has_request(self, request_id: Hashable) -> bool:
        """Whether the request was added (and not removed), compiled or not."""
        return request_id in self._matchers or request_id in self._pending

    def is_ready(self, request_id: Hashable, wait: bool = False) -> bool:
        """Whether the request's grammar is compiled (schedule it only then). `wait` blocks up to the time limit.

        Raises StructuredOutputError if the constraint is invalid or its compilation passed the time limit: the
        engine fails that request alone (finish_reason "error", the message as its error).
        """
        if request_id in self._matchers:
            return True
        future, what = self._pending[request_id]
        if not wait and not future.done() and not self.compiler.is_late(future):
            return False
        try:
            compiled = self.compiler.result(future, what)
        except StructuredOutputError:
            self._pending.pop(request_id, None)
            raise
        self._matchers[request_id] = RequestMatcher(compiled)  # before leaving `_pending`: has_request stays True
        self._pending.pop(request_id, None)
        return True

    def pending(self) -> list[Hashable]:
        """The requests added whose compilation `is_ready` has not yet taken up (done or not)."""
        return list(self._pending)

    def wait_pending(self, timeout: float) -> bool:
        """Block until one of the pending compilations is done or past its time limit, or for `timeout` s at most.
        False at once when none is pending."""
        entries = list(self._pending.values())
        if not entries:
            return False
        deadlines = [d for f, _ in entries if (d := self.compiler.deadline(f)) is not None]
        if deadlines:
            timeout = max(0.0, min(timeout, min(deadlines) - time.monotonic()))
        concurrent.futures.wait([f for f, _ in entries], timeout, return_when=concurrent.futures.FIRST_COMPLETED)
        return True

    def fill_bitmask(self, request_ids: Sequence[Hashable | None],
                     draft_tokens: Sequence[Sequence[int]] | None = None) -> BatchBitmask | None:
        """Fill the bitmask rows of the constrained requests among `request_ids` (one per batch row, in order).

        With `draft_tokens` (one list per request), request i takes 1 + len(draft_tokens[i]) consecutive rows, in
        the layout of the verification logits (see RequestMatcher.fill_draft_bitmask). Returns None when no row is
        constrained. Runs on the CPU; no matcher may be advanced while it runs.
        """
        drafts = draft_tokens if draft_tokens is not None else [()] * len(request_ids)
        num_rows = sum(1 + len(d) for d in drafts)
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = allocate_bitmask(num_rows, self.vocab_size)
        rows, open_rows, singles, single_rows, row = [], [], [], [], 0
        for request_id, draft in zip(request_ids, drafts, strict=True):
            matcher = self._matchers.get(request_id) if request_id is not None else None
            if matcher is not None and not matcher.is_terminated():
                rows.extend(range(row, row + 1 + len(draft)))
                if draft:
                    matcher.fill_draft_bitmask(self._bitmask, row, draft)
                else:
                    singles.append(matcher.xgr_matcher)
                    single_rows.append(row)
            else:
                open_rows.extend(range(row, row + 1 + len(draft)))
            row += 1 + len(draft)
        if not rows:
            return None
        if singles:  # xgrammar fills these on its own threads
            self._batch_matcher.batch_fill_next_token_bitmask(singles, self._bitmask, single_rows)
        allow_all(self._bitmask, open_rows)  # so the bitmask alone is a whole step's mask
        return BatchBitmask(self._bitmask[:num_rows], rows)

    def fill_next_bitmask(self, request_ids: Sequence[Hashable | None],
                          draft_tokens: Sequence[Sequence[int]]) -> BatchBitmask | None:
        """One row per request: the tokens its grammar allows after its accepted tokens and then its draft tokens
        (proposing the next draft); a row allowing nothing where the drafts end or break the grammar. None when no
        request is constrained. The matchers' states are unchanged."""
        if len(request_ids) > self._bitmask.shape[0]:
            self._bitmask = allocate_bitmask(len(request_ids), self.vocab_size)
        rows, open_rows = [], []
        for row, (request_id, draft) in enumerate(zip(request_ids, draft_tokens, strict=True)):
            matcher = self._matchers.get(request_id) if request_id is not None else None
            if matcher is None:
                open_rows.append(row)
                continue
            matcher.fill_after(self._bitmask, row, draft)
            rows.append(row)
        if not rows:
            return None
        allow_all(self._bitmask, open_rows)
        return BatchBitmask(self._bitmask[: len(request_ids)], rows)

    def fill_bitmask_async(self, request_ids: Sequence[Hashable | None],
                           draft_tokens: Sequence[Sequence[int]] | None = None) -> Future:
        """`fill_bitmask` on the manager's filler thread, so it runs while the forward does; `.result()` is its
        return value. Accept tokens only after the result is in."""
        return self._filler.submit(self.fill_bitmask, list(request_ids), draft_tokens)

    def apply_bitmask(self, logits: torch.Tensor, mask: BatchBitmask) -> None:
        """Set the disallowed logits of the constrained rows to -inf, in place (logits [num_rows, vocab_size])."""
        apply_bitmask(logits, mask.bitmask, mask.rows)

    def accept(self, request_id: Hashable, token: int) -> bool:
        """Advance the request's matcher by its sampled token. False means the token broke the grammar (a sampler
        that did not honour the mask): the engine should fail the request. Unconstrained requests: always True."""
        matcher = self._matchers.get(request_id)
        return True if matcher is None else matcher.accept(token)

    def rollback(self, request_id: Hashable, num_tokens: int) -> None:
        """Undo the request's last `num_tokens` accepted tokens (drafts accepted before verification rejected them)."""
        matcher = self._matchers.get(request_id)
        if matcher is not None:
            matcher.rollback(num_tokens)

    def is_terminated(self, request_id: Hashable) -> bool:
        """True once the request's grammar has accepted its stop token: finish it with finish_reason "stop"."""
        matcher = self._matchers.get(request_id)
        return matcher is not None and matcher.is_terminated()

    def matcher(self, request_id: Hashable) -> RequestMatcher | None:
        """The request's matcher, None if it has none (unconstrained, or not compiled yet)."""
        return self._matchers.get(request_id)

    def remove_request(self, request_id: Hashable) -> None:
        """Forget a finished or aborted request."""
        self._pending.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the compile and fill threads (compilations already running finish in the background)."""
        self.compiler.shutdown()
        self._filler.shutdown(wait=False, cancel_futures=True)
