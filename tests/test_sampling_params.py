"""SamplingParams: every out-of-range field raises a ValueError that names it; valid values pass through."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deepinfer.sampling_params import SamplingParams

BAD_VALUES = [
    ("n", 0), ("n", -3), ("n", 1.5), ("n", True),
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5), ("top_p", math.nan),
    ("top_k", -2), ("top_k", 2.0),
    ("min_p", -0.01), ("min_p", 1.5),
    ("seed", 1.0), ("seed", "7"),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 3),
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2.5),
    ("min_tokens", -1), ("min_tokens", 17),  # 17 > the default max_tokens of 16
    ("logprobs", -2), ("logprobs", 1.5),  # -1: the whole vocabulary, as vLLM
    ("prompt_logprobs", -2), ("prompt_logprobs", "3"),
    ("logit_bias", [1, 2]), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: math.inf}), ("logit_bias", {"x": 1.0}),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", 5),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", [3]),
    ("presence_penalty", 2.5), ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("include_stop_str_in_output", None),
    ("structured_outputs", {"json": {"type": "object"}}),
]


@pytest.mark.parametrize("name,value", BAD_VALUES)
def test_out_of_range_raises_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        SamplingParams(**{name: value})


def test_every_field_has_a_range_check() -> None:
    import dataclasses

    checked = {name for name, _ in BAD_VALUES}
    assert checked == {f.name for f in dataclasses.fields(SamplingParams)}


def test_defaults_are_vllms() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and p.logprobs is None
    assert not p.is_greedy and SamplingParams(temperature=0).is_greedy


def test_logit_bias_keys_may_be_json_strings() -> None:
    assert SamplingParams(logit_bias={"12": 5, 3: -1.5}).logit_bias == {12: 5.0, 3: -1.5}


def test_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_min_tokens_is_bounded_by_max_tokens_only_when_set() -> None:
    assert SamplingParams(min_tokens=100, max_tokens=None).min_tokens == 100
    with pytest.raises(ValueError, match="min_tokens must be in \\[0, max_tokens=4\\]"):
        SamplingParams(min_tokens=5, max_tokens=4)


valid_params = st.fixed_dictionaries({
    "n": st.integers(1, 8),
    "temperature": st.floats(0, 100),
    "top_p": st.floats(0, 1, exclude_min=True),
    "top_k": st.integers(-1, 1000),
    "min_p": st.floats(0, 1),
    "seed": st.none() | st.integers(-(2**70), 2**70),
    "stop": st.none() | st.text(min_size=1) | st.lists(st.text(min_size=1), max_size=3),
    "stop_token_ids": st.none() | st.lists(st.integers(0, 200000), max_size=4),
    "max_tokens": st.none() | st.integers(16, 4096),
    "min_tokens": st.integers(0, 16),
    "ignore_eos": st.booleans(),
    "logprobs": st.none() | st.integers(-1, 20),
    "prompt_logprobs": st.none() | st.integers(-1, 20),
    "logit_bias": st.none() | st.dictionaries(st.integers(0, 200000), st.floats(-100, 100), max_size=4),
    "allowed_token_ids": st.none() | st.lists(st.integers(0, 200000), min_size=1, max_size=4),
    "bad_words": st.none() | st.lists(st.text(min_size=1).filter(str.strip), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0, 10, exclude_min=True),
    "skip_special_tokens": st.booleans(),
})


@given(valid_params)
def test_valid_values_are_accepted_and_kept(kwargs: dict) -> None:
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name == "stop":
            assert p.stop == ([] if value is None else [value] if isinstance(value, str) else value)
        elif name == "stop_token_ids":
            assert p.stop_token_ids == (value or [])
        else:
            assert getattr(p, name) == value
    assert p.is_greedy == (p.temperature < 1e-5)
