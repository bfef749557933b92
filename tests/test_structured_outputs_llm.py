"""Structured outputs through `LLM.generate`: valid completions, "stop" when the grammar completes, errors alone, and
a grammar still compiling holds back its own request only."""

from __future__ import annotations

import json
import re
import threading
import time

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.structured_outputs.compiler import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    from deepinfer.default_model import default_model

    return LLM(default_model())  # random weights on the V4 tokenizer: any token may come, so masks must hold


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


@pytest.fixture
def slow_regex(monkeypatch):
    """Compiling the regex "slow..." blocks until the event returned is set (set at the end of the test anyway)."""
    release = threading.Event()
    compile_ = GrammarCompiler._compile

    def compile_slowly(self, params):
        if params.regex is not None and params.regex.startswith("slow"):
            release.wait(60)
        return compile_(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", compile_slowly)
    yield release
    release.set()


def test_a_compiling_grammar_holds_back_only_its_own_request(llm: LLM, slow_regex: threading.Event) -> None:
    slow_params = _params(21, regex="slow-[0-9]{2}")
    free_params = SamplingParams(temperature=1.0, seed=22, max_tokens=6)
    slow_id = llm.engine.add_request("p", slow_params)
    free_id = llm.engine.add_request("q", free_params)  # added after the slow one, and unconstrained
    outs = {}
    for out in llm.engine.run():
        outs[out.request_id] = out
        if out.request_id == free_id:
            assert slow_id not in outs and not slow_regex.is_set()  # done while the grammar was still compiling
            slow_regex.set()
    assert list(outs) == [free_id, slow_id]
    slow, free = outs[slow_id].outputs[0], outs[free_id].outputs[0]
    assert re.fullmatch("slow-[0-9]{2}", slow.text) and slow.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 6
    # Seeded outputs are those of the same requests run with nothing held back (the grammar is cached by now).
    again = llm.generate(["p", "q"], [slow_params, free_params], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [slow.token_ids, free.token_ids]


def test_a_grammar_past_the_time_limit_fails_its_request_without_spinning(llm: LLM, slow_regex: threading.Event,
                                                                          monkeypatch) -> None:
    monkeypatch.setattr(llm.engine.runner.constraint.manager.compiler, "timeout_s", 0.5)
    num_schedules = 0
    schedule = llm.engine.scheduler.schedule

    def counted():
        nonlocal num_schedules
        num_schedules += 1
        return schedule()

    monkeypatch.setattr(llm.engine.scheduler, "schedule", counted)
    start = time.monotonic()
    (out,) = llm.generate(["p"], [_params(23, regex="slow-too")], use_tqdm=False)
    assert out.outputs[0].finish_reason == "error" and "took longer than the 0.5 s limit" in out.error
    assert 0.5 <= time.monotonic() - start < 10
    assert num_schedules <= 6  # the engine slept on the compilation rather than polled it
