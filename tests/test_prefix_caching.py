"""Prefix caching through the engine: over request mixes that share prefixes, outputs and every sampled logits row are
bitwise those without it (batch-invariant mode), under budgets small enough to evict and preempt, with drafting."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.cli import build_parser, llm_kwargs
from deepinfer.default_model import default_model
from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.engine.block_manager import CacheLayout
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from dsl.cache import CacheSpec
from tests.conftest import fixture_dir

VOCAB = 512


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(fixture_dir("v41-tiny-engram")), target="cpu", max_model_len=256)


def _engine(llm: LLM, num_drafts: int = 0, budget_blocks: int | None = None, num_snapshots: int = 2,
            interval: int | None = None, enable_prefix_caching: bool = False, **args) -> LLMEngine:
    """An engine on `llm`'s model, prefix caching off unless asked for; with `budget_blocks`, a cache budget of the
    slots, that many blocks and room for `num_snapshots` snapshots (when prefix caching takes its share);
    `interval`: snapshots every that many tokens (rather than the layout's choice)."""
    if budget_blocks is not None:
        spec = CacheSpec.from_graph(llm.compiled.graph, spare=num_drafts)
        block_size = CacheLayout.check_block_size(spec, None)
        slots = args.get("max_num_seqs", 4) + num_snapshots
        args["kv_cache_memory_bytes"] = slots * spec.slot_bytes() + budget_blocks * spec.block_bytes(block_size)
    engine_args = EngineArgs(max_model_len=args.pop("max_model_len", 256), enable_prefix_caching=enable_prefix_caching,
                             **args)
    engine = LLMEngine(llm.compiled, llm.tokenizer, engine_args, llm.eos_token_ids, speculator=llm.engine.speculator)
    engine.threads = llm.engine.threads  # the cpu threads LLM chose for this machine's load
    if interval is not None:
        engine.prefix_cache.interval = interval
    return engine


def _generate(engine: LLMEngine, mix) -> tuple[list, dict]:
    """The outputs of `mix` in order, and every sampled row's logits by (request, sample, position)."""
    logits: dict[tuple[str, int, int], torch.Tensor] = {}
    forward = engine.runner._forward

    def recording(batch, rows, *rest):  # the real forward, its sampled rows kept
        out = forward(batch, rows, *rest)
        first = 0
        for row in rows:
            count = 1 + row.num_drafts if engine.speculator is not None else 1
            if row.sample is not None:
                seq = next(s for s in engine.requests[row.sample.request_id].seqs if s.seq_id == row.seq_id)
                end = row.start + len(row.token_ids)
                for i in range(count):
                    logits[(seq.request_id, seq.index, end - count + i)] = out[first + i].clone()
            first += count
        return out

    engine.runner._forward = recording
    ids = [engine.add_request({"prompt_token_ids": prompt}, params) for prompt, params in mix]
    by_id = {o.request_id: o for o in engine.run()}
    return [by_id[i] for i in ids], logits


def _check_same(plain, cached, plain_logits: dict, cached_logits: dict) -> None:
    for a, b in zip(plain, cached, strict=True):
        assert a.error is None and b.error is None
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.token_ids == y.token_ids and x.logprobs == y.logprobs and x.finish_reason == y.finish_reason
            for i in range(len(x.token_ids)):  # the logits every output token was sampled from
                key = (a.request_id, x.index, len(a.prompt_token_ids) + i - 1)
                assert torch.equal(plain_logits[key], cached_logits[key]), key
    both = plain_logits.keys() & cached_logits.keys()  # with drafts, rejected positions too where both ran them
    assert all(torch.equal(plain_logits[k], cached_logits[k]) for k in both)


@st.composite
def mixes(draw, max_prompt: int = 100, max_tokens: int = 12) -> list[tuple[list[int], SamplingParams]]:
    """Requests whose prompts are prefixes of a few shared stems, each with its own tail, any sampling."""
    rng = random.Random(draw(st.integers(0, 2**31)))
    stems = [[rng.randrange(VOCAB) for _ in range(max_prompt)] for _ in range(draw(st.integers(1, 2)))]
    mix = []
    for _ in range(draw(st.integers(2, 5))):
        stem = stems[draw(st.integers(0, len(stems) - 1))]
        prompt = stem[: draw(st.integers(1, max_prompt - 12))] + [rng.randrange(VOCAB)
                                                                   for _ in range(draw(st.integers(0, 12)))]
        params = SamplingParams(n=draw(st.integers(1, 2)), temperature=draw(st.sampled_from([0.0, 0.8])),
                                max_tokens=draw(st.integers(1, max_tokens)), seed=draw(st.integers(0, 2**31)),
                                logprobs=draw(st.sampled_from([None, 2])), ignore_eos=True)
        mix.append((prompt, params))
    return mix


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=mixes(), async_scheduling=st.booleans(), tokens=st.sampled_from([32, 512]),
       budget=st.sampled_from([None, 16]), num_snapshots=st.integers(1, 3))
def test_prefix_caching_gives_the_same_outputs_and_logits(llm: LLM, mix, async_scheduling: bool, tokens: int,
                                                          budget: int | None, num_snapshots: int) -> None:
    args = {"async_scheduling": async_scheduling, "max_num_batched_tokens": tokens, "max_num_seqs": 4,
                "budget_blocks": budget, "num_snapshots": num_snapshots}
    plain = _generate(_engine(llm, **args), mix)
    engine = _engine(llm, enable_prefix_caching=True, **args)
    cached = _generate(engine, mix)
    _check_same(*plain[:1], *cached[:1], plain[1], cached[1])
    cache = engine.prefix_cache
    assert not cache.pending and len(cache.free_snapshots) + len(cache.snapshot_lru) == engine.layout.num_snapshots
    assert engine.scheduler.block_manager.num_free_blocks == engine.layout.num_blocks  # every block came back


def test_samples_and_repeated_prompts_resume_from_the_cache(llm: LLM) -> None:
    prompt = list(range(100, 190))
    engine = _engine(llm, enable_prefix_caching=True)
    outs, _ = _generate(engine, [(prompt, SamplingParams(n=3, max_tokens=4, temperature=0.8, seed=1))])
    # the first sample computes the prompt; the others wait for its snapshot at 80 and resume there
    assert outs[0].num_cached_tokens == 0 and engine.prefix_cache.num_hit_tokens == 2 * 80
    again, _ = _generate(engine, [(prompt + [5, 6], SamplingParams(max_tokens=2))])
    assert again[0].num_cached_tokens == 80
    plain, _ = _generate(_engine(llm), [(prompt, SamplingParams(max_tokens=2))] * 2)
    assert [o.num_cached_tokens for o in plain] == [0, 0] and _engine(llm).prefix_cache is None


def test_a_preempted_sequence_resumes_from_the_cache(llm: LLM) -> None:
    """Two sequences of 130 tokens and 16 blocks of 16 beside 3 snapshots: the newer is preempted, its last blocks go
    to the other, and it resumes from its snapshot at 64 (its prompt's last boundary) or a later one."""
    rng = random.Random(3)
    mix = [([rng.randrange(VOCAB) for _ in range(70)], SamplingParams(max_tokens=60, ignore_eos=True))
           for _ in range(2)]
    args = {"budget_blocks": 16, "max_num_seqs": 2, "num_snapshots": 3}
    plain = _generate(_engine(llm, **args), mix)
    engine = _engine(llm, enable_prefix_caching=True, **args)
    cached = _generate(engine, mix)
    _check_same(plain[0], cached[0], plain[1], cached[1])
    # the prompts share no block: every hit is a recompute's
    assert engine.num_preemptions == 1 and all(o.num_cached_tokens == 0 for o in cached[0])
    assert engine.layout.num_blocks == 16 and engine.prefix_cache.num_hit_tokens >= 64


@pytest.fixture(scope="module")
def drafting() -> LLM:
    return LLM(default_model(), max_num_seqs=4, speculative_config={"method": "dspark", "num_speculative_tokens": 4})


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=mixes(max_prompt=160, max_tokens=16), budget=st.sampled_from([None, 24]))
def test_prefix_caching_with_drafting_gives_the_same_outputs_and_logits(drafting: LLM, mix, budget) -> None:
    """The draft layers' windows come back with the snapshot; with a snapshot due every block, verifications pass
    snapshot positions (taken only where the drafts before them were accepted)."""
    args = {"num_drafts": 4, "budget_blocks": budget, "max_num_seqs": 4, "max_model_len": 256}
    plain = _generate(_engine(drafting, **args), mix)
    cached = _generate(_engine(drafting, enable_prefix_caching=True, interval=16, **args), mix)
    _check_same(plain[0], cached[0], plain[1], cached[1])


def test_prefix_caching_is_on_by_default() -> None:
    assert EngineArgs().enable_prefix_caching


def test_the_command_line_flag_reaches_the_engine() -> None:
    args = build_parser().parse_args(["generate", "--enable-prefix-caching", "x"])
    assert llm_kwargs(args)["enable_prefix_caching"] is True
    assert llm_kwargs(build_parser().parse_args(["generate", "--no-enable-prefix-caching", "x"]))[
        "enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in llm_kwargs(build_parser().parse_args(["generate", "x"]))
