"""Structured outputs through `LLM.generate`: valid completions, "stop" when the grammar completes, errors alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def _params(seed: int, **constraint) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=40,
                          structured_outputs=StructuredOutputsParams(disable_any_whitespace=True, **constraint))


def test_constrained_batch_is_valid_and_deterministic(llm: LLM) -> None:
    prompts = ["a", "b", "c", "d", "e", "f"]
    params = [_params(1, json=SCHEMA), _params(2, regex=r"[a-c]{2}-\d"), _params(3, choice=["red", "green"]),
              SamplingParams(temperature=1.0, seed=4, max_tokens=5), _params(5, json={"type": "nothing"}),
              _params(6, grammar='root ::= "x" ("y" | "z")')]
    outs = llm.generate(prompts, params, use_tqdm=False)
    schema_out, regex_out, choice_out, free, broken, grammar_out = (o.outputs[0] for o in outs)
    jsonschema.validate(json.loads(schema_out.text), SCHEMA)
    assert re.fullmatch(r"[a-c]{2}-\d", regex_out.text)
    assert choice_out.text in ("red", "green")
    assert re.fullmatch("x[yz]", grammar_out.text)
    for out in (schema_out, regex_out, choice_out, grammar_out):
        assert out.finish_reason == "stop", out
    assert free.finish_reason == "length" and len(free.token_ids) == 5  # unconstrained beside them: untouched
    assert broken.finish_reason == "error" and outs[4].error and "nothing" in outs[4].error
    again = llm.generate(prompts[:3], params[:3], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:3]]
