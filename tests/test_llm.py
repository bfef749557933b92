"""LLM.generate end to end on the cpu target, on the smooth fixture (whose greedy tokens the reference recorded)."""

from __future__ import annotations

import pytest

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams
from tests.conftest import SMOOTH, fixture_dir, oracle

FIXTURE = "v41-smooth"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(fixture_dir(FIXTURE)), target="cpu", max_model_len=80)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return oracle(FIXTURE)["input_ids"][0].tolist()


@pytest.fixture(scope="module")
def greedy_tokens() -> list[int]:
    return oracle(FIXTURE)["greedy_tokens"][0].tolist()


GREEDY16 = SamplingParams(temperature=0, max_tokens=16)


@pytest.mark.parametrize("name", SMOOTH)
def test_greedy_matches_the_reference(name: str) -> None:
    data = oracle(name)
    prompt, greedy_tokens = data["input_ids"][0].tolist(), data["greedy_tokens"][0].tolist()
    out = LLM(str(fixture_dir(name)), target="cpu").generate([{"prompt_token_ids": prompt}], GREEDY16,
                                                               use_tqdm=False)[0]
    assert out.error is None and out.finished
    assert out.outputs[0].token_ids == greedy_tokens
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].stop_reason is None
    assert out.prompt_token_ids == prompt
    assert out.metrics.num_generated_tokens == 16 and out.metrics.tokens_per_s > 0
    assert 0 < out.metrics.time_to_first_token <= out.metrics.total_time


def test_bad_requests_fail_alone(llm: LLM, prompt: list[int], greedy_tokens: list[int]) -> None:
    requests = [
        {"prompt_token_ids": prompt},
        {"prompt_token_ids": []},
        {"prompt_token_ids": prompt[:5] + [512]},  # the fixture's vocabulary is 512
        {"prompt_token_ids": prompt + prompt},  # 96 tokens > max_model_len 80
        "def fib(n):",  # the V4 tokenizer's ids lie beyond the fixture's vocabulary
        {"prompt_token_ids": prompt},
    ]
    outs = llm.generate(requests, GREEDY16, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for good in (outs[0], outs[5]):
        assert good.error is None and good.outputs[0].token_ids == greedy_tokens
    for bad, needle in zip(outs[1:5], ["empty", "512 is outside the vocabulary", "max_model_len=80", "outside"]):
        assert bad.error is not None and needle in bad.error, bad.error
        assert bad.finished and [c.finish_reason for c in bad.outputs] == ["error"]
        assert bad.outputs[0].token_ids == [] and bad.outputs[0].text == ""
    assert outs[2].prompt_token_ids == prompt[:5] + [512] and outs[4].prompt == "def fib(n):"  # reported as given


def test_generation_stops_at_max_model_len(llm: LLM, prompt: list[int], greedy_tokens: list[int]) -> None:
    long_prompt = {"prompt_token_ids": prompt + greedy_tokens[:10]}  # 58 tokens: room for 22 more under 80
    out = llm.generate(long_prompt, SamplingParams(temperature=0, max_tokens=None), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 22 and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids[:6] == greedy_tokens[10:16]


def test_stop_token_ids_and_min_tokens(llm: LLM, prompt: list[int], greedy_tokens: list[int]) -> None:
    stop_at = greedy_tokens[5]
    assert stop_at not in greedy_tokens[:5]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_tokens[:6] and out.finish_reason == "stop" and out.stop_reason == stop_at
    banned = SamplingParams(temperature=0, stop_token_ids=[stop_at], min_tokens=8, max_tokens=8)
    out = llm.generate({"prompt_token_ids": prompt}, banned, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 8 and out.token_ids[:5] == greedy_tokens[:5] and out.token_ids[5] != stop_at


def test_stop_strings_trim_the_text(llm: LLM, prompt: list[int]) -> None:
    full = llm.generate({"prompt_token_ids": prompt}, GREEDY16, use_tqdm=False)[0].outputs[0]
    # A stop string of whole characters from the middle (the random model also emits bytes of split characters).
    starts = [i for i in range(1, len(full.text) - 1)
              if all(c.isprintable() and c != "\ufffd" for c in full.text[i:i + 2])]
    assert starts, repr(full.text)
    stop = full.text[starts[len(starts) // 2]:starts[len(starts) // 2] + 2]
    cut = full.text.find(stop)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, stop=[stop, "§¤"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == full.token_ids[:len(out.token_ids)] and len(out.token_ids) < 16
    kept = SamplingParams(temperature=0, max_tokens=16, stop=stop, include_stop_str_in_output=True)
    out = llm.generate({"prompt_token_ids": prompt}, kept, use_tqdm=False)[0].outputs[0]
    assert out.text == full.text[:cut + len(stop)]


def test_stop_strings_before_min_tokens_are_ignored(llm: LLM, prompt: list[int]) -> None:
    full = llm.generate({"prompt_token_ids": prompt}, GREEDY16, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    stop = next(full.text[i:i + 2] for i in range(len(full.text) - 1)
                if all(c.isprintable() and c != "\ufffd" for c in full.text[i:i + 2]))
    assert full.text.count(stop) == 1
    completes_at = next(k for k in range(1, 17) if stop in tokenizer.decode(full.token_ids[:k]))
    stopped = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, stop=stop),
                           use_tqdm=False)[0].outputs[0]
    assert len(stopped.token_ids) == completes_at and stopped.finish_reason == "stop"
    late = SamplingParams(temperature=0, max_tokens=16, stop=stop, min_tokens=completes_at + 2)
    out = llm.generate({"prompt_token_ids": prompt}, late, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids and out.finish_reason == "length" and out.text == full.text


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm: LLM, prompt: list[int]) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=1234)
    alone = llm.generate({"prompt_token_ids": prompt}, seeded, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=0.7, max_tokens=5, seed=9)
    batch = llm.generate([{"prompt_token_ids": prompt[:20]}, {"prompt_token_ids": prompt}],
                         [other, seeded], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone and batch[1].seed == 1234
    reseeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=1235)
    assert llm.generate({"prompt_token_ids": prompt}, reseeded, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_unseeded_requests_report_the_seed_they_used(llm: LLM, prompt: list[int]) -> None:
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6), use_tqdm=False)[0]
    assert isinstance(first.seed, int)
    again = SamplingParams(max_tokens=6, seed=first.seed)
    assert llm.generate({"prompt_token_ids": prompt}, again, use_tqdm=False)[0].outputs[0].token_ids == \
        first.outputs[0].token_ids
    second = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6), use_tqdm=False)[0]
    assert second.seed != first.seed


def test_n_samples_are_independent_and_sample_zero_matches_n1(llm: LLM, prompt: list[int]) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 3 and all(len(s) == 8 for s in samples)
    single = SamplingParams(temperature=1.0, max_tokens=8, seed=5)
    assert tuple(llm.generate({"prompt_token_ids": prompt}, single, use_tqdm=False)[0].outputs[0].token_ids) == \
        samples[0]


def test_logprobs_rank_the_sampled_tokens(llm: LLM, prompt: list[int], greedy_tokens: list[int]) -> None:
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy_tokens[:4] and len(out.logprobs) == 4
    for token, step in zip(out.token_ids, out.logprobs):
        assert len(step) == 3 and step[token].rank == 1  # greedy picks the most likely token
        assert sorted(lp.rank for lp in step.values()) == [1, 2, 3]
        assert all(lp.logprob <= 0 and lp.decoded_token is not None for lp in step.values())
    assert out.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs)))
    plain = llm.generate({"prompt_token_ids": prompt}, GREEDY16, use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_one_params_per_prompt_must_match_the_prompt_count(llm: LLM, prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate([{"prompt_token_ids": prompt}], [GREEDY16, GREEDY16], use_tqdm=False)
