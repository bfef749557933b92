"""Compiling constraints into xgrammar grammars: off the engine's loop, `max_workers` at once, cached by content.

`submit` returns at once with a future; requests with the same constraint share one compilation (the cache holds
futures, so a second request arriving mid-compilation waits for the first's). Each compilation runs on a daemon
thread of its own once one of the `max_workers` slots is free. The time limit counts from when it starts compiling,
not from submission, so time spent queued behind other grammars does not count. A compilation past its limit fails
the requests waiting on it and gives its slot up; xgrammar's native code cannot be stopped, so it finishes in the
background and fills the cache for later requests, and, its thread being a daemon, never keeps the process from
exiting. Before compiling, a grammar that no finite text matches is refused (deepinfer/structured_outputs/finite.py),
as is a schema with no instance or one xgrammar would not enforce (schema_support.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import xgrammar as xgr

from deepinfer.structured_outputs.finite import check_finite
from deepinfer.structured_outputs.params import StructuredOutputError, StructuredOutputsParams
from deepinfer.structured_outputs.schema_support import check_schema_supported, rewrite_for_xgrammar

_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar", "choice": "choice"}
# xgrammar's messages start with a timestamp and a C++ source location: "[12:40:09] /project/cpp/x.cc:94: ..."
_NATIVE_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?\S+\.(cc|h):\d+:\s*")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`: JSON string literals are valid EBNF literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class CompileFuture(Future):
    """A compilation's future, with the monotonic time it started compiling (None while queued for a slot)."""

    def __init__(self) -> None:
        super().__init__()
        self.started_at: float | None = None
        self._slot_held = False


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer info; results are kept in an LRU of `cache_size` entries."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_workers: int = 2, cache_size: int = 128,
                 timeout_s: float = 30.0) -> None:
        if cache_size < 1 or max_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need cache_size >= 1, max_workers >= 1 and timeout_s > 0, got {cache_size}, "
                             f"{max_workers}, {timeout_s}")
        # xgrammar's own cache is off: this LRU is the one cache, bounded, and it also de-duplicates in-flight work.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_workers, cache_enabled=False)
        self._slots = threading.Semaphore(max_workers)
        self._cache: OrderedDict[tuple[str, str, bool], CompileFuture] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.cache_size = cache_size
        self.timeout_s = timeout_s

    def submit(self, params: StructuredOutputsParams) -> CompileFuture:
        """A future of the compiled grammar (xgr.CompiledGrammar); it raises StructuredOutputError if invalid."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = CompileFuture()
            if self._closed:
                future.cancel()
            else:
                threading.Thread(target=self._run, args=(future, params), name="grammar-compile", daemon=True).start()
            self._cache[key] = future
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _run(self, future: CompileFuture, params: StructuredOutputsParams) -> None:
        """Wait for a slot, then compile; the slot is given up at the end or once the time limit passes."""
        self._slots.acquire()
        if not future.set_running_or_notify_cancel():
            self._slots.release()
            return
        future.started_at, future._slot_held = time.monotonic(), True
        limit = threading.Timer(self.timeout_s, self._release, (future,))
        limit.daemon = True
        limit.start()
        try:
            future.set_result(self._compile(params))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)
        finally:
            limit.cancel()
            self._release(future)

    def _release(self, future: CompileFuture) -> None:
        with self._lock:
            held, future._slot_held = future._slot_held, False
        if held:
            self._slots.release()

    def deadline(self, future: CompileFuture) -> float | None:
        """When `future` passes its time limit (monotonic), None while it waits for a slot."""
        return None if future.started_at is None else future.started_at + self.timeout_s

    def is_late(self, future: CompileFuture) -> bool:
        """Whether `future` is still compiling past its time limit."""
        deadline = self.deadline(future)
        return not future.done() and deadline is not None and time.monotonic() >= deadline

    def result(self, future: CompileFuture, what: str = "the constraint") -> xgr.CompiledGrammar:
        """The compiled grammar of `future`, waiting while it is queued and then at most until its time limit."""
        while future.started_at is None and not future.done():
            try:
                return future.result(timeout=0.05)
            except FutureTimeout:
                continue
        remaining = (self.deadline(future) or time.monotonic()) - time.monotonic()
        try:
            return future.result(timeout=max(remaining, 0.0))
        except FutureTimeout:
            raise StructuredOutputError(f"compiling {what} took longer than the {self.timeout_s:g} s limit") from None

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile (or fetch from the cache), blocking up to the time limit."""
        return self.result(self.submit(params), f"the {_WHAT[params.kind]}")

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, text, compact = params.key
        try:
            if kind == "json":
                check_schema_supported(params.schema)
                schema = json.dumps(rewrite_for_xgrammar(params.schema), ensure_ascii=False)
                grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=not compact)
            elif kind == "regex":
                grammar = xgr.Grammar.from_regex(text)
            else:
                grammar = xgr.Grammar.from_ebnf(choice_grammar(params.choice) if kind == "choice" else text)
            check_finite(grammar, _WHAT[kind])
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            if isinstance(e, StructuredOutputError):
                raise
            message = _NATIVE_PREFIX.sub("", str(e)).strip()
            raise StructuredOutputError(f"invalid {_WHAT[kind]}: {message}") from None

    def shutdown(self) -> None:
        """Stop taking work: compilations still queued are cancelled; those compiling finish in the background."""
        with self._lock:
            self._closed = True
            futures = list(self._cache.values())
        for future in futures:
            future.cancel()
