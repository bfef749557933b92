"""What a constraint admits is what it says: enum/const and required as the schema means them, no constraint without a
finite match, malformed keyword values named, messages that say why a constraint cannot be met, and a compile clock
that starts when compiling does."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest
import xgrammar as xgr

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.structured_outputs.compiler import GrammarCompiler
from deepinfer.structured_outputs.finite import productive_rules
from deepinfer.structured_outputs.params import StructuredOutputError
from deepinfer.structured_outputs.tokenizer_info import build_tokenizer_info
from deepinfer.tokenizer import load_tokenizer

VOCAB, EOS = 129280, 1
ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def compiler():
    compiler = GrammarCompiler(build_tokenizer_info(load_tokenizer(), VOCAB, [EOS]))
    yield compiler
    compiler.shutdown()


def matches(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.accept_token(EOS)


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"type": "string", "enum": [1, "a"]}, ['"a"'], ["1"]),  # xgrammar alone lets 1 through
    ({"type": "integer", "enum": [1, 5, 7], "maximum": 6}, ["1", "5"], ["7"]),
    ({"type": "string", "enum": ["a", "abc"], "minLength": 2}, ['"abc"'], ['"a"']),
    ({"const": 3, "minimum": 1}, ["3"], ["1"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, ['{"b": 1}', '{"a": 1, "b": 2}'],
     ['{"a": 1}', "{}"]),
    ({"type": "object", "required": ["b"], "additionalProperties": {"type": "string"}}, ['{"b": "x"}'],
     ["{}", '{"b": 1}']),
])
def test_the_values_a_schema_admits_are_the_schema_s(compiler, schema: dict, valid: list[str],
                                                    invalid: list[str]) -> None:
    compiled = compiler.compile(StructuredOutputsParams(json=schema))
    for text in valid:
        jsonschema.validate(json.loads(text), schema)
        assert matches(compiled, text), text
    for text in invalid:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(text), schema)
        assert not matches(compiled, text), text


@pytest.mark.parametrize("params,message", [
    (StructuredOutputsParams(json={"type": "string", "const": 5}), "admits no value at /: none of its enum/const"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"],
                                   "additionalProperties": False}), "requires 'b', which is not among its properties"),
    (StructuredOutputsParams(json={"anyOf": []}), "'anyOf' at / must be a non-empty list"),
    (StructuredOutputsParams(json={"type": "string", "minLength": -1}), "'minLength' at / must be a non-negative"),
    (StructuredOutputsParams(json={"type": "string", "format": 3}), "'format' at / must be a string"),
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "maxItems": "3"}), "maxItems"),
    (StructuredOutputsParams(json={"type": "string", "enum": ["a"], "format": "email"}), "'format' at / (xgrammar"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}),
     "the JSON schema matches no finite text"),
    (StructuredOutputsParams(json={"type": "array", "items": {"$ref": "#"}, "minItems": 1}), "matches no finite text"),
    (StructuredOutputsParams(grammar='root ::= "a" root'), "the EBNF grammar matches no finite text"),
    (StructuredOutputsParams(grammar='root ::= "(" inner\ninner ::= "x" inner | "y" inner'), "no finite text"),
])
def test_constraints_that_cannot_be_honoured_fail_at_once(compiler, params, message: str) -> None:
    with pytest.raises(StructuredOutputError, match=message.replace("(", "\\(")):
        compiler.compile(params)


def test_the_finite_check_reads_recursion_that_ends() -> None:
    for text in ['root ::= "(" root ")" | "x"', 'root ::= ("a" root)?', 'root ::= [a-z]+ ("," root)*']:
        known, names = productive_rules(str(xgr.Grammar.from_ebnf(text)))
        assert "root" in known and known == names, text
    linked = {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
              "required": ["next"]}
    json_grammar = str(xgr.Grammar.from_json_schema(json.dumps(linked)))
    assert "root" in productive_rules(json_grammar)[0]


def test_stop_strings_do_not_combine_with_a_constraint() -> None:
    schema = StructuredOutputsParams(json={"type": "object"})
    for stops in ({"stop": [","]}, {"stop_token_ids": [14]}):
        with pytest.raises(ValueError, match="do not combine with structured_outputs"):
            SamplingParams(structured_outputs=schema, **stops)


@pytest.fixture(scope="module")
def llm() -> LLM:
    from deepinfer.default_model import default_model

    return LLM(default_model())  # random weights on the V4 tokenizer: any token may come, so masks must hold


def test_a_constraint_that_cannot_be_met_says_why(llm: LLM) -> None:
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [SamplingParams(min_tokens=8, max_tokens=10, seed=1, structured_outputs=choice),
              SamplingParams(allowed_token_ids=[5, 6], max_tokens=10, seed=2, structured_outputs=choice)]
    outs = llm.generate(["x", "y"], params, use_tqdm=False)
    assert "the choice constraint cannot be satisfied after" in outs[0].error
    assert "min_tokens=8 bans its end" in outs[0].error and "sampler" not in outs[0].error
    assert "allowed_token_ids leaves out what it allows" in outs[1].error


SCHEMAS = [
    {"type": "object", "properties": {"kind": {"type": "string", "enum": ["a", 2, "b"]}, "n": {"type": "integer",
                                                                                              "enum": [1, 50]}},
     "required": ["kind", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x", "y"]},
    {"type": "array", "items": {"enum": [True, 1, "t"], "type": "boolean"}, "minItems": 1, "maxItems": 2},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum-in-object", "required-unlisted", "enum-items"])
def test_every_stop_result_satisfies_its_schema(llm: LLM, schema: dict) -> None:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=48, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True)) for s in range(8)]
    outs = llm.generate(["x"] * 8, params, use_tqdm=False)
    stopped = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert stopped and all(o.error is None for o in outs)
    for out in stopped:
        jsonschema.validate(json.loads(out.text), schema)


def test_the_time_limit_counts_compiling_not_waiting(monkeypatch) -> None:
    release, real = threading.Event(), GrammarCompiler._compile

    def compile_(self, params):
        if params.regex == "held":
            release.wait(60)
        return real(self, params)

    monkeypatch.setattr(GrammarCompiler, "_compile", compile_)
    compiler = GrammarCompiler(build_tokenizer_info(load_tokenizer(), VOCAB, [EOS]), max_workers=1, timeout_s=3.0)
    try:
        held = compiler.submit(StructuredOutputsParams(regex="held"))  # holds the one slot until its limit
        queued = compiler.submit(StructuredOutputsParams(regex="queued"))
        assert queued.started_at is None
        with pytest.raises(StructuredOutputError, match="took longer than the 3 s limit"):
            compiler.result(held, "the held regex")
        assert compiler.result(queued, "the queued regex") is not None  # queued 3 s, yet compiled within its limit
        assert queued.started_at >= held.started_at + 3.0
    finally:
        release.set()
        compiler.shutdown()


ABANDON = """
import threading, time
from deepinfer.structured_outputs.compiler import GrammarCompiler
from deepinfer.structured_outputs.params import StructuredOutputError, StructuredOutputsParams
from deepinfer.structured_outputs.tokenizer_info import build_tokenizer_info
from deepinfer.tokenizer import load_tokenizer

GrammarCompiler._compile = lambda self, params: threading.Event().wait()  # a compile that never ends
compiler = GrammarCompiler(build_tokenizer_info(load_tokenizer(), 129280, [1]), timeout_s=0.2)
try:
    compiler.compile(StructuredOutputsParams(regex="x"))
except StructuredOutputError as e:
    print("abandoned:", e)
"""


def test_an_abandoned_compile_does_not_keep_the_process_from_exiting() -> None:
    run = subprocess.run([sys.executable, "-c", ABANDON], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         check=False)  # before: it never exited
    assert run.returncode == 0 and "abandoned: compiling the regex took longer than the 0.2 s limit" in run.stdout
