"""The manager and the compiler on the real V4 tokenizer: batches with and without constraints, drafts, errors that
fail one request, the compile time limit, the cache, and the model runner's constraint hook."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.structured_outputs import StructuredOutputConstraint, StructuredOutputError, StructuredOutputsParams
from deepinfer.structured_outputs.bitmask import allocate_bitmask, unpack_bitmask
from deepinfer.structured_outputs.compiler import GrammarCompiler
from deepinfer.structured_outputs.manager import StructuredOutputManager
from deepinfer.structured_outputs.tokenizer_info import build_tokenizer_info
from deepinfer.tokenizer import load_tokenizer

VOCAB = 129280
EOS = 1


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def manager(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB, [EOS])
    yield manager
    manager.shutdown()


def test_manager_masks_only_constrained_rows(manager, tokenizer) -> None:
    manager.add_request("json", StructuredOutputsParams(json={"type": "integer", "minimum": 1, "maximum": 9}))
    manager.add_request("choice", StructuredOutputsParams(choice=["yes", "no"]))
    assert manager.is_ready("json", wait=True) and manager.is_ready("choice", wait=True)
    batch = ["plain", "json", None, "choice"]  # "plain" never asked for a constraint
    mask = manager.fill_bitmask(batch)
    assert mask.rows == [1, 3] and mask.bitmask.shape == (4, VOCAB // 32)
    logits = torch.randn(4, VOCAB)
    masked = logits.clone()
    manager.apply_bitmask(masked, mask)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    digits = {tokenizer.decode([t]) for t in masked[1].isfinite().nonzero().flatten().tolist()}
    assert digits == set("123456789")  # an integer in [1, 9]: its one digit
    assert {tokenizer.decode([t]) for t in masked[3].isfinite().nonzero().flatten().tolist()} >= {"y", "n"}
    assert not masked[1].isnan().any() and torch.equal(masked[1][masked[1].isfinite()], logits[1][masked[1].isfinite()])
    assert torch.equal(manager.fill_bitmask_async(batch).result().bitmask, mask.bitmask)
    assert manager.fill_bitmask(["plain", None]) is None  # nothing constrained: nothing to apply
    for request_id in ("json", "choice"):
        manager.remove_request(request_id)
    assert manager.fill_bitmask(batch) is None


def test_manager_accept_terminate_and_grow(manager, tokenizer) -> None:
    manager.add_request("r", StructuredOutputsParams(choice=["no"]))
    assert manager.is_ready("r", wait=True)
    assert manager.accept("unconstrained", 12345) and not manager.is_terminated("unconstrained")
    assert not manager.accept("r", tokenizer.encode("yes")[0])
    for token in [*tokenizer.encode("no"), EOS]:
        assert manager.accept("r", token)
    assert manager.is_terminated("r")
    assert manager.fill_bitmask(["r"]) is None  # finished: the engine has ended it, its row is not masked
    manager.rollback("r", 1)
    many = ["r"] * 300  # past the preallocated 256 rows: the buffer grows
    assert manager.fill_bitmask(many).rows == list(range(300))
    manager.remove_request("r")


def test_manager_lays_out_draft_rows_per_request(manager, tokenizer) -> None:
    manager.add_request("d1", StructuredOutputsParams(regex=r"[a-c]{2,4}"))
    manager.add_request("d2", StructuredOutputsParams(choice=["yes", "no"]))
    assert manager.is_ready("d1", wait=True) and manager.is_ready("d2", wait=True)
    a, b = (tokenizer.encode(ch)[0] for ch in "ab")
    mask = manager.fill_bitmask(["d1", "plain", "d2"], draft_tokens=[[a, b], [a], []])
    assert mask.rows == [0, 1, 2, 5] and mask.bitmask.shape[0] == 6  # d1: 1 + 2 rows, plain: 1 + 1, d2: 1
    assert unpack_bitmask(mask.bitmask[3:5], VOCAB).all()  # the unconstrained request's rows stay open
    expected = allocate_bitmask(3, VOCAB)
    assert manager.matcher("d1").fill_draft_bitmask(expected, 0, [a, b]) == 2
    assert torch.equal(mask.bitmask[:3], expected)
    assert manager.matcher("d1").num_tokens == 0  # filling drafts leaves the matchers where they were
    for request_id in ("d1", "d2"):
        manager.remove_request(request_id)


@pytest.mark.parametrize("params,message", [
    (StructuredOutputsParams(json={"type": "strin"}), "invalid JSON schema: Unsupported type \"strin\""),
    (StructuredOutputsParams(json={"$ref": "#/$defs/missing"}), "invalid JSON schema: .*missing"),
    (StructuredOutputsParams(json={"type": "array", "minItems": 3, "maxItems": 1}), "minItems is greater than maxItems"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "'uniqueItems' at / "),
    (StructuredOutputsParams(regex="a(b"), "invalid regex: .*parenthesis is not closed"),
    (StructuredOutputsParams(regex="(?<=a)b"), "invalid regex: .*Lookbehind"),
    (StructuredOutputsParams(regex="a\x00b"), "invalid regex: The regex must not contain null characters"),
    (StructuredOutputsParams(grammar='root ::= "a" |'), "invalid EBNF grammar: .*line 1"),
    (StructuredOutputsParams(grammar='start ::= "a"'), "invalid EBNF grammar: .*root"),
])
def test_invalid_constraints_fail_the_request_naming_the_problem(manager, params, message: str) -> None:
    manager.add_request("bad", params)
    with pytest.raises(StructuredOutputError, match=message) as info:
        manager.is_ready("bad", wait=True)
    assert "/project/cpp" not in str(info.value)  # xgrammar's source locations are trimmed
    assert manager.matcher("bad") is None
    manager.add_request("good", StructuredOutputsParams(regex="ok"))  # the manager carries on for other requests
    assert manager.is_ready("good", wait=True)
    manager.remove_request("good")


def test_compilation_past_the_time_limit_fails(tokenizer) -> None:
    slow = StructuredOutputsParams(regex="[a-z]{1,4000}")  # about a second to compile at this vocabulary
    limited = StructuredOutputManager(tokenizer, VOCAB, [EOS], compile_timeout_s=0.02)
    limited.add_request("slow", slow)
    assert not limited.is_ready("slow")  # not done, not late yet: the engine schedules other work
    with pytest.raises(StructuredOutputError, match="compiling the regex constraint took longer than the 0.02 s"):
        limited.is_ready("slow", wait=True)
    limited.shutdown()


def test_cache_shares_compilations_by_content_and_evicts(tokenizer) -> None:
    compiler = GrammarCompiler(build_tokenizer_info(tokenizer, VOCAB, [EOS]), cache_size=2)
    first = compiler.submit(StructuredOutputsParams(json={"type": "boolean"}))
    assert compiler.submit(StructuredOutputsParams(json='{"type":  "boolean"}')) is first
    compiler.submit(StructuredOutputsParams(regex="a"))
    compiler.submit(StructuredOutputsParams(regex="b"))  # evicts the least recently used: the schema
    assert compiler.submit(StructuredOutputsParams(json={"type": "boolean"})) is not first
    compiler.shutdown()


@dataclass
class _Row:
    """The two fields of the model runner's SampleRow the constraint reads."""

    seq_id: int
    params: SamplingParams


def test_runner_constraint_masks_per_sequence_and_reports_errors(manager, tokenizer) -> None:
    constraint = StructuredOutputConstraint(manager)
    yes_no = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    broken = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b"))
    rows = [_Row(10, yes_no), _Row(11, SamplingParams()), _Row(12, yes_no), _Row(13, broken)]
    constraint.submit(10, yes_no)  # as the engine does when the request arrives; 12 is compiled at its fill
    bitmask = constraint.fill(rows)
    allowed = unpack_bitmask(bitmask, VOCAB)  # [4, vocab]
    assert allowed[1].all() and allowed[3].all()  # unconstrained, and failed: open rows, the step goes on
    assert torch.equal(allowed[0], allowed[2]) and 2 <= allowed[0].sum() <= 10
    y, n = tokenizer.encode("y")[0], tokenizer.encode("n")[0]
    ended = constraint.accept(rows, [[y], [5], [n], [7]])  # the two yes/no sequences go separate ways
    assert list(ended) == [13] and "invalid regex" in ended[13]  # the broken one is reported once, here
    no = {tokenizer.decode([t]) for t in unpack_bitmask(constraint.fill(rows[2:3]), VOCAB)[0].nonzero().flatten()}
    assert no == {"o"}
    assert constraint.accept(rows[2:3], [[tokenizer.encode("o")[0]]]) == {}  # "no" is matched; eos still to come
    eos = tokenizer.eos_token_id
    assert constraint.accept(rows[2:3], [[eos]]) == {12: None}  # the grammar is complete: the sequence stops
    ended = constraint.accept(rows[:1], [[tokenizer.encode("x")[0]]])  # a token the grammar refuses
    assert list(ended) == [10] and "breaks the choice constraint" in ended[10]
    constraint.finish([10, 11, 12, 13])
    assert constraint.fill(rows) is not None  # sequences seen again start afresh (a new request reusing the ids)
    constraint.finish([10, 11, 12, 13])
    assert constraint.fill(rows[1:2]) is None


def test_constraint_readiness_never_blocks_and_wait_ready_sleeps_on_the_compilation(manager, tokenizer,
                                                                                      monkeypatch) -> None:
    release, compile_ = threading.Event(), GrammarCompiler._compile
    monkeypatch.setattr(GrammarCompiler, "_compile", lambda self, params: release.wait(60) and compile_(self, params))
    constraint = StructuredOutputConstraint(manager)
    held = SamplingParams(structured_outputs=StructuredOutputsParams(regex="held[0-9]"))
    broken = SamplingParams(structured_outputs=StructuredOutputsParams(regex="held("))
    try:
        assert constraint.is_ready(30) and not constraint.wait_ready(1.0)  # unconstrained: nothing to wait for
        constraint.submit(31, held)
        constraint.submit(32, broken)
        start = time.monotonic()
        assert not constraint.is_ready(31) and not constraint.is_ready(32)
        assert time.monotonic() - start < 1  # asking does not wait (the compilation blocks for 60 s)
        assert constraint.wait_ready(0.3) and 0.25 < time.monotonic() - start < 5  # slept its timeout out
        threading.Timer(0.2, release.set).start()
        assert constraint.wait_ready(30) and time.monotonic() - start < 10  # woken by a compilation ending
        while not (constraint.is_ready(31) and constraint.is_ready(32)):
            assert constraint.wait_ready(30)
        assert not constraint.wait_ready(30)  # none compiling any more: returns at once
        assert time.monotonic() - start < 10
    finally:
        release.set()
    ended = constraint.accept([_Row(31, held), _Row(32, broken)], [[tokenizer.encode("h")[0]], [5]])
    assert list(ended) == [32] and "invalid regex" in ended[32]  # ready, and failed: its request fails at once
    constraint.finish([31, 32])


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread: torch starts no OpenMP team")
def test_filling_on_a_thread_starts_no_openmp_team(manager) -> None:
    """A torch op going parallel on the fill thread would start a second OpenMP team there, and libgomp with more
    threads than cores stops spinning between parallel regions: the forward ran about 2x slower from then on."""
    manager.add_request("t", StructuredOutputsParams(regex="[a-z]+"))
    assert manager.is_ready("t", wait=True)
    batch = ["t"] + [None] * 15  # 15 open rows: 60600 words, past torch's grain for going parallel (32768)
    manager.fill_bitmask(batch)  # on this thread first: whatever xgrammar starts lazily is started by now
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: None).result()  # the thread exists before the count
        before = set(os.listdir("/proc/self/task"))
        assert pool.submit(manager.fill_bitmask, batch).result().rows == [0]
        assert pool.submit(allocate_bitmask, 300, VOCAB).result().eq(-1).all()
        started = set(os.listdir("/proc/self/task")) - before
    assert not started  # an OpenMP team would have started its worker threads
    manager.remove_request("t")
