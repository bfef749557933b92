"""Compiling constraints into xgrammar grammars: in a thread pool, off the engine's loop, cached by content.

`submit` returns at once with a future; requests with the same constraint share one compilation (the cache holds
futures, so a second request arriving mid-compilation waits for the first's). The time limit is measured from
submission: a compilation past it fails the requests waiting on it, though xgrammar's native code cannot be stopped,
so it finishes in the background and fills the cache for later requests.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import xgrammar as xgr

from deepinfer.structured_outputs.params import StructuredOutputError, StructuredOutputsParams
from deepinfer.structured_outputs.schema_support import check_schema_supported, rewrite_for_xgrammar

_WHAT = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar", "choice": "choice"}
# xgrammar's messages start with a timestamp and a C++ source location: "[12:40:09] /project/cpp/x.cc:94: ..."
_NATIVE_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?\S+\.(cc|h):\d+:\s*")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`: JSON string literals are valid EBNF literals."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer info; results are kept in an LRU of `cache_size` entries."""

    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_workers: int = 2, cache_size: int = 128,
                 timeout_s: float = 30.0) -> None:
        if cache_size < 1 or max_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need cache_size >= 1, max_workers >= 1 and timeout_s > 0, got {cache_size}, "
                             f"{max_workers}, {timeout_s}")
        # xgrammar's own cache is off: this LRU is the one cache, bounded, and it also de-duplicates in-flight work.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=max_workers, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self._cache: OrderedDict[tuple[str, str, bool], Future] = OrderedDict()
        self._lock = threading.Lock()
        self.cache_size = cache_size
        self.timeout_s = timeout_s

    def submit(self, params: StructuredOutputsParams) -> Future:
        """A future of the compiled grammar (xgr.CompiledGrammar); it raises StructuredOutputError if invalid."""
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def result(self, future: Future, submitted_at: float, what: str = "the constraint") -> xgr.CompiledGrammar:
        """The compiled grammar of `future`, waiting at most until `submitted_at` + the time limit."""
        remaining = submitted_at + self.timeout_s - time.monotonic()
        try:
            return future.result(timeout=max(remaining, 0.0))
        except FutureTimeout:
            raise StructuredOutputError(f"compiling {what} took longer than the {self.timeout_s:g} s limit") from None

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile (or fetch from the cache), blocking up to the time limit."""
        return self.result(self.submit(params), time.monotonic(), f"the {_WHAT[params.kind]}")

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        kind, text, compact = params.key
        try:
            if kind == "json":
                check_schema_supported(params.schema)
                schema = json.dumps(rewrite_for_xgrammar(params.schema), ensure_ascii=False)
                return self._compiler.compile_json_schema(schema, any_whitespace=not compact)
            if kind == "regex":
                return self._compiler.compile_regex(text)
            return self._compiler.compile_grammar(choice_grammar(params.choice) if kind == "choice" else text)
        except (RuntimeError, ValueError) as e:
            if isinstance(e, StructuredOutputError):
                raise
            message = _NATIVE_PREFIX.sub("", str(e)).strip()
            raise StructuredOutputError(f"invalid {_WHAT[kind]}: {message}") from None

    def shutdown(self) -> None:
        """Stop taking work; compilations already running finish in the background."""
        self._pool.shutdown(wait=False, cancel_futures=True)
