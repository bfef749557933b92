"""StructuredOutputsParams: exactly one constraint, of the right type, or a ValueError naming the problem."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepinfer import SamplingParams, StructuredOutputsParams
from deepinfer.structured_outputs import StructuredOutputError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("kwargs,message", [
    ({}, "exactly one of json, regex, grammar, choice; got none"),
    ({"json": SCHEMA, "regex": "a+"}, "got json and regex"),
    ({"regex": "a", "grammar": 'root ::= "a"', "choice": ["a"]}, "got regex and grammar and choice"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON schema .* got list"),
    ({"json": 3}, "must be a JSON schema .* got int"),
    ({"json": {"const": float("nan")}}, "not serialisable as JSON"),
    ({"json": {"default": object()}}, "not serialisable as JSON"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"regex": b"a+"}, "regex must be a non-empty string"),
    ({"grammar": ""}, "grammar must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
    ({"choice": "red"}, "choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, "choice must be a non-empty list of strings"),
    ({"json": SCHEMA, "disable_any_whitespace": 1}, "disable_any_whitespace must be True or False"),
])
def test_malformed_params_raise_naming_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(StructuredOutputError, match=message):
        StructuredOutputsParams(**kwargs)


def test_the_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        StructuredOutputsParams(json="{")


@pytest.mark.parametrize("kwargs,kind", [
    ({"json": SCHEMA}, "json"), ({"json": True}, "json"), ({"regex": r"\d+"}, "regex"),
    ({"grammar": 'root ::= "x"'}, "grammar"), ({"choice": ("a", "")}, "choice"),
])
def test_kind(kwargs: dict, kind: str) -> None:
    assert StructuredOutputsParams(**kwargs).kind == kind


def test_schema_text_and_dict_share_a_key_but_key_order_matters() -> None:
    as_dict = StructuredOutputsParams(json=SCHEMA)
    as_text = StructuredOutputsParams(json='{"type": "object",\n "properties": {"b": {"type": "integer"}, '
                                           '"a": {"type": "string"}}}')
    reordered = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"},
                                                                               "b": {"type": "integer"}}})
    assert as_dict.key == as_text.key
    assert as_dict.key != reordered.key  # xgrammar emits properties in declared order: a different grammar
    assert as_dict.schema == SCHEMA
    assert StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).key != as_dict.key


def test_choice_is_copied_to_a_list_and_keyed_by_content() -> None:
    choices = ("yes", "no")
    p = StructuredOutputsParams(choice=choices)
    assert p.choice == ["yes", "no"]
    assert p.key == StructuredOutputsParams(choice=["yes", "no"]).key
    assert p.key != StructuredOutputsParams(choice=["no", "yes"]).key
    assert StructuredOutputsParams(regex="yes|no").key != p.key


def test_schema_of_a_non_json_request_raises() -> None:
    with pytest.raises(AttributeError, match="not a JSON schema"):
        StructuredOutputsParams(regex="a").schema  # noqa: B018


def test_sampling_params_carries_structured_outputs() -> None:
    so = StructuredOutputsParams(choice=["a", "b"])
    assert SamplingParams(structured_outputs=so).structured_outputs is so
    assert SamplingParams().structured_outputs is None
    with pytest.raises(ValueError, match="^structured_outputs must be a StructuredOutputsParams or None, got dict"):
        SamplingParams(structured_outputs={"choice": ["a"]})


def test_importing_deepinfer_does_not_import_xgrammar() -> None:
    # xgrammar brings transformers (seconds of import): only requests with constraints may pay for it
    code = ("import sys, deepinfer; from deepinfer import StructuredOutputsParams as P; P(choice=['a']); "
            "print('xgrammar' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
