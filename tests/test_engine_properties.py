"""Property tests over request mixes: every request finishes once, with the right finish reason, and with the tokens
it gets under any other schedule (batch-invariant mode on)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tests.conftest import fixture_dir

MAX_MODEL_LEN = 40
VOCAB = 512
# The fixture's random weights favour some tokens and pieces of text: stops drawn from these happen often.
LIKELY_TOKENS = [453, 380, 416, 317, 507, 261]
LIKELY_TEXT = ["est", " P", "el", " re", "\ufffd", "a"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(fixture_dir("v41-tiny-engram")), target="cpu", max_model_len=MAX_MODEL_LEN)


@st.composite
def requests(draw) -> tuple[list[int], SamplingParams]:
    kind = draw(st.sampled_from(["ok"] * 6 + ["empty", "outside", "too long"]))
    length = {"empty": 0, "too long": MAX_MODEL_LEN}.get(kind, draw(st.integers(1, 30)))
    prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=length, max_size=length))
    if kind == "outside":
        prompt[draw(st.integers(0, length - 1))] = VOCAB + draw(st.integers(0, 5))
    max_tokens = draw(st.integers(1, 12))
    params = SamplingParams(
        n=draw(st.integers(1, 3)), temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
        top_p=draw(st.sampled_from([1.0, 0.8])), top_k=draw(st.sampled_from([0, 5])), max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)), seed=draw(st.integers(0, 2**31)),
        stop=draw(st.lists(st.sampled_from(LIKELY_TEXT), max_size=2)),
        stop_token_ids=draw(st.lists(st.sampled_from(LIKELY_TOKENS) | st.integers(0, VOCAB - 1), max_size=3)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.sampled_from([None, 2])), repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
    )
    return prompt, params


def _run(llm: LLM, mix, **engine_args) -> tuple[list, LLMEngine]:
    engine = LLMEngine(llm.compiled, llm.tokenizer, EngineArgs(max_model_len=MAX_MODEL_LEN, **engine_args),
                       llm.eos_token_ids)
    ids = [engine.add_request({"prompt_token_ids": prompt}, params) for prompt, params in mix]
    outputs = list(engine.run())
    assert sorted(int(o.request_id) for o in outputs) == sorted(int(i) for i in ids)  # each once, none lost
    by_id = {o.request_id: o for o in outputs}
    return [by_id[i] for i in ids], engine


def _check_finish(prompt: list[int], params: SamplingParams, completion, eos: tuple[int, ...], tokenizer) -> None:
    tokens, reason = completion.token_ids, completion.finish_reason
    room = MAX_MODEL_LEN - len(prompt)
    assert 1 <= len(tokens) <= min(params.max_tokens, room)
    assert len(tokens) >= min(params.min_tokens, room)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    assert not stops & set(tokens[:-1])  # nothing that stops a sequence comes before its end
    if reason == "length":
        assert len(tokens) == min(params.max_tokens, room) and completion.stop_reason is None
    else:
        assert reason == "stop"
        if isinstance(completion.stop_reason, str):  # the text ends where the stop string starts
            full = tokenizer.decode(tokens)
            assert completion.stop_reason in params.stop and full.startswith(completion.text)
            assert full[len(completion.text):].startswith(completion.stop_reason)
        elif completion.stop_reason is not None:
            assert completion.stop_reason == tokens[-1] and tokens[-1] in params.stop_token_ids
        else:
            assert tokens[-1] in eos and not params.ignore_eos
    if params.logprobs is not None:
        assert len(completion.logprobs) == len(tokens)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=st.lists(requests(), min_size=1, max_size=5), async_scheduling=st.booleans(),
       max_num_batched_tokens=st.sampled_from([3, 16, 512]), max_num_seqs=st.sampled_from([2, 8]),
       small_cache=st.booleans())
def test_request_mixes_finish_with_the_right_reasons_and_tokens(llm: LLM, mix, async_scheduling: bool,
                                                                 max_num_batched_tokens: int, max_num_seqs: int,
                                                                 small_cache: bool) -> None:
    layout = llm.engine.layout  # 3 blocks of 16 tokens: one sequence of MAX_MODEL_LEN
    budget = layout.num_slots * layout.slot_bytes + 3 * layout.block_bytes if small_cache else None
    outputs, _ = _run(llm, mix, async_scheduling=async_scheduling, max_num_batched_tokens=max_num_batched_tokens,
                      max_num_seqs=max_num_seqs, kv_cache_memory_bytes=budget)
    reference, _ = _run(llm, mix, async_scheduling=False)
    for (prompt, params), out, ref in zip(mix, outputs, reference, strict=True):
        assert out.prompt_token_ids == prompt and out.seed == params.seed
        valid = prompt and max(prompt) < VOCAB and len(prompt) < MAX_MODEL_LEN
        if not valid:
            assert out.error and [c.finish_reason for c in out.outputs] == ["error"] * params.n
            continue
        assert out.error is None and [c.index for c in out.outputs] == list(range(params.n))
        for completion, expected in zip(out.outputs, ref.outputs, strict=True):
            _check_finish(prompt, params, completion, llm.eos_token_ids, llm.tokenizer)
            assert (completion.token_ids, completion.text) == (expected.token_ids, expected.text)
