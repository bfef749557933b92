"""Batch invariance: the measured facts it rests on, bitwise logits across batches and chunkings, and the same
tokens across engine settings, orders and cache budgets (batch-invariant mode on)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from dsl.ops.invariant import InvariantElementwise, padded_rows
from tests.conftest import SMOOTH, fixture_dir, oracle, rel_l2

linear = torch.nn.functional.linear


# The facts of dsl/ops/invariant.py, on this machine's torch. If one fails here, the method needs revisiting.
def test_gemm_rows_agree_from_12_rows_and_at_4_and_8_but_not_below() -> None:
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(40, 64, generator=g)
    reference = linear(x, w)
    same = [m for m in range(1, 41) if torch.equal(linear(x[:m], w), reference[:m])]
    assert all(m in same for m in (4, 8, *range(12, 41)))
    assert all(torch.equal(linear(torch.cat([x[:m], x.new_zeros(padded_rows(m) - m, 64)]), w)[:m], reference[:m])
               for m in range(1, 41))
    assert not torch.equal(linear(x[:1], w), reference[:1])  # why the padding exists: a lone row is a GEMV


def test_gemm_columns_agree_from_12_columns() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 32, generator=g), torch.randn(200, 32, generator=g)
    reference = linear(x, w)
    assert all(torch.equal(linear(x, w[:n]), reference[:, :n]) for n in range(12, 200, 7))


def test_bmm_elements_do_not_depend_on_the_batch_count() -> None:
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(50, 4, 64, generator=g), torch.randn(50, 64, 72, generator=g)
    reference = torch.bmm(a, b)
    assert all(torch.equal(torch.bmm(a[:n], b[:n]), reference[:n]) for n in range(1, 50))


def test_bmm_elements_are_their_own_mm() -> None:
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(8, 64, 32, generator=g), torch.randn(8, 32, 16, generator=g)
    together = torch.bmm(a, b)
    assert all(torch.equal(together[e], torch.mm(a[e], b[e])) for e in range(8))


def test_gemm_rows_agree_when_stacked_and_columns_whatever_their_layout() -> None:
    g = torch.Generator().manual_seed(8)
    w, x = torch.randn(6, 32, 64, generator=g), torch.randn(16, 64, generator=g)  # 6 experts of 32 rows
    stacked = torch.mm(w.reshape(-1, 64), x.t())
    assert all(torch.equal(stacked[32 * e : 32 * (e + 1)], torch.mm(w[e], x.t())) for e in range(6))
    assert torch.equal(torch.mm(w[0], x.t()), torch.mm(w[0], x.t().contiguous()))


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.nn.functional.silu, torch.nn.functional.softplus])
def test_invariant_elementwise_functions_do_not_depend_on_the_tensor_size(fn) -> None:
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 4
    with InvariantElementwise():
        reference = fn(x)
        pieces = torch.cat([fn(x[i : i + 1 + i % 31]) for i in range(0, 4096, 32)])
    assert torch.equal(pieces, torch.cat([reference[i : i + 1 + i % 31] for i in range(0, 4096, 32)]))
    torch.testing.assert_close(reference, fn(x), rtol=2e-6, atol=1e-7)  # the same function, rounded its own way


def test_softmax_over_a_middle_dim_varies_with_the_leading_size_unless_composed() -> None:
    gate = torch.randn(64, 2, 40, generator=torch.Generator().manual_seed(4))  # the compressor's groups, D = 40
    with InvariantElementwise():
        composed = gate.softmax(dim=1)
        assert all(torch.equal(gate[:g].softmax(dim=1), composed[:g]) for g in range(1, 64))
    assert not all(torch.equal(gate[:g].softmax(dim=1), gate.softmax(dim=1)[:g]) for g in range(1, 64))


@pytest.mark.parametrize("name", SMOOTH)
def test_the_invariant_path_computes_the_model(name: str, compiled_fixture) -> None:
    """Same model, other rounding: the reference's logits within the parity tests' bound."""
    model, ref = compiled_fixture(name), oracle(name)
    ids = torch.from_numpy(ref["full_ids"]).long()
    logits = model.step([(model.new_sequence(), row.tolist()) for row in ids], all_logits=True, batch_invariant=True)
    assert rel_l2(logits.reshape(ref["full_logits"].shape).numpy(), ref["full_logits"]) < 1e-4


# Logits, bit for bit.
def _last_logits(model, prompt: list[int], chunks: list[int], company: list[list[int]]) -> list[torch.Tensor]:
    """Logits after `prompt` fed in `chunks`, then of two decode steps, with other sequences in every step."""
    state, others = model.new_sequence(), [model.new_sequence() for _ in company]
    rows, start = [], 0
    for i, n in enumerate(chunks):
        batch = [(s, p[i % len(p):][:3] or [5]) for s, p in zip(others, company, strict=True)]
        batch.insert(i % (len(batch) + 1), (state, prompt[start : start + n]))
        logits = model.step(batch, batch_invariant=True)
        rows.append(logits[[s for s, _ in batch].index(state)])
        start += n
    for token in (3, 9):
        batch = [(state, [token])] + [(s, [token + 1]) for s in others]
        rows.append(model.step(batch, batch_invariant=True)[0])
    return [rows[len(chunks) - 1], *rows[len(chunks):]]


@pytest.mark.parametrize("name", ["v41-tiny-engram", "v41-smooth"])
def test_logits_are_bitwise_the_same_alone_in_a_batch_and_chunked(name: str, compiled_fixture) -> None:
    model = compiled_fixture(name)
    rng = random.Random(0)
    prompt = [rng.randrange(512) for _ in range(41)]
    company = [[rng.randrange(512) for _ in range(n)] for n in (5, 30, 1)]
    alone = _last_logits(model, prompt, [41], [])
    for chunks, others in [([41], company), ([1] * 3 + [38], company[:1]), ([7, 7, 7, 20], company), ([40, 1], [])]:
        together = _last_logits(model, prompt, chunks, others)
        assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True)), chunks


# Tokens through the engine.
PROMPTS_RNG = random.Random(1)
PROMPTS = [{"prompt_token_ids": [PROMPTS_RNG.randrange(512) for _ in range(n)]} for n in (3, 40, 17, 1, 26, 9)]
PARAMS = [SamplingParams(n=1 + i % 2, temperature=(0.0, 0.8, 1.0)[i % 3], top_p=(1.0, 0.9)[i % 2], seed=100 + i,
                         max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(fixture_dir("v41-tiny-engram")), target="cpu", max_model_len=96)


def _run(llm: LLM, order: list[int] | None = None, **engine_args) -> tuple[list[list[list[int]]], LLMEngine]:
    """Each request's completions (in input order) from a fresh engine with `engine_args`, and the engine."""
    order = order or list(range(len(PROMPTS)))
    engine = LLMEngine(llm.compiled, llm.tokenizer, EngineArgs(**{"max_model_len": 96, **engine_args}),
                       llm.eos_token_ids)
    ids = [engine.add_request(PROMPTS[i], PARAMS[i]) for i in order]
    outputs = {out.request_id: out for out in engine.run()}
    by_input = {i: outputs[rid] for i, rid in zip(order, ids, strict=True)}
    return [[c.token_ids for c in by_input[i].outputs] for i in order], engine


def _tokens(llm: LLM, order: list[int] | None = None, **engine_args) -> list[list[list[int]]]:
    tokens, _ = _run(llm, order, **engine_args)
    return tokens if order is None else [t for _, t in sorted(zip(order, tokens, strict=True))]


def test_the_same_tokens_whatever_the_schedule(llm: LLM) -> None:
    baseline = _tokens(llm)
    assert all(len(c) == PARAMS[i].max_tokens for i, out in enumerate(baseline) for c in out)
    assert _tokens(llm) == baseline  # across runs
    assert _tokens(llm, async_scheduling=False) == baseline
    assert _tokens(llm, max_num_batched_tokens=5) == baseline  # prompts in chunks of at most 5 tokens
    assert _tokens(llm, max_num_seqs=2, order=[5, 3, 1, 0, 2, 4]) == baseline  # other batches, other order
    assert [_tokens(llm, order=[i])[0] for i in (1, 4)] == [baseline[1], baseline[4]]  # alone


def test_a_cache_too_small_for_the_batch_preempts_and_loses_nothing(llm: LLM) -> None:
    baseline = _tokens(llm)
    layout = llm.engine.layout
    # The slots, and the fewest blocks the engine accepts: one sequence of max_model_len (96 tokens, 6 blocks).
    budget = layout.num_slots * layout.slot_bytes + 6 * layout.block_bytes
    for async_scheduling in (True, False):
        tokens, engine = _run(llm, kv_cache_memory_bytes=budget, async_scheduling=async_scheduling)
        assert tokens == baseline and engine.num_preemptions > 0
