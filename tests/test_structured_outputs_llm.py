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


def test_command_line_constraints_per_line_and_as_flags(tmp_path, capsys) -> None:
    from deepinfer.cli import main

    prompts = tmp_path / "prompts.jsonl"
    lines = [{"id": "num", "prompt": "x", "regex": "[0-9]{3}"}, {"id": "dir", "prompt": "y", "choice": ["up", "down"]},
             {"id": "bad", "prompt": "z", "regex": "a(b"}, {"id": "two", "prompt": "w", "regex": "a", "choice": ["b"]},
             {"id": "flag", "prompt": "v"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    results = tmp_path / "results.jsonl"
    code = main(["generate", "--input", str(prompts), "--output", str(results), "--no-progress", "--regex", "[xy]z"])
    assert code == 1  # two lines failed, alone
    got = {r["id"]: r for r in map(json.loads, results.read_text().splitlines())}
    assert re.fullmatch("[0-9]{3}", got["num"]["outputs"][0]["text"])
    assert got["dir"]["outputs"][0]["text"] in ("up", "down")
    assert re.fullmatch("[xy]z", got["flag"]["outputs"][0]["text"])  # the flag's constraint, where a line has none
    assert "invalid regex" in got["bad"]["error"] and "exactly one" in got["two"]["error"]


def test_grammar_compiles_from_submission(llm: LLM) -> None:
    """Compilation starts when the request is added, not at its first sample."""
    request_id = llm.engine.add_request("q", _params(9, regex="[0-9]{2}"))
    waiting = [s for s in llm.engine.scheduler.waiting if s.request_id == request_id]
    assert waiting and all(llm.engine.runner.constraint.manager.has_request(s.seq_id) for s in waiting)
    (out,) = [o for o in llm.engine.run() if o.request_id == request_id]
    assert re.fullmatch("[0-9]{2}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"
