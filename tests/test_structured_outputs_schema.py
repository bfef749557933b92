"""JSON-schema support: every keyword xgrammar would ignore is named, with its place; the rewrite around its string
length bug; and canaries showing xgrammar still ignores each rejected keyword (so a rule can be dropped when not)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from deepinfer.structured_outputs import StructuredOutputError
from deepinfer.structured_outputs.schema_support import (
    check_schema_supported,
    rewrite_for_xgrammar,
    unsupported_keywords,
)

# (schema, keyword it uses that xgrammar ignores, an instance that breaks that keyword and nothing else)
IGNORED = [
    ({"type": "integer", "not": {"const": 3}}, "not", "3"),
    ({"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, "if", "9"),
    ({"type": "integer", "if": {"minimum": 3}, "else": {"const": 0}}, "else", "1"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired", '{"a":1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", '{"a":1}'),
    ({"type": "array", "contains": {"type": "integer"}}, "contains", "[]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxContains": 1}, "maxContains",
     "[1,1]"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "[1,1]"),
    ({"type": "string", "format": "regex"}, "format", '"("'),
    ({"type": "string", "format": "date", "pattern": "^2020"}, "pattern", '"2021-01-01"'),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "minLength", '"a"'),
    ({"type": "string", "format": "date", "maxLength": 3}, "maxLength", '"2021-01-01"'),
    ({"allOf": [{"type": "integer"}, {"minimum": 0}]}, "allOf", '"x"'),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "1"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf", "0.3"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0}, "multipleOf", "4"),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 20000}, "multipleOf", "4"),
    ({"$defs": {"a": {"type": "integer"}}, "$dynamicRef": "#/$defs/a"}, "$dynamicRef", '"x"'),
]

SUPPORTED = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}}, "required": ["name"]},
    {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]},
    {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 30},
    {"type": "integer", "multipleOf": 7},
    {"type": "array", "uniqueItems": False, "items": {"type": "string", "format": "date-time"}},
    {"$defs": {"p": {"type": "integer"}}, "anyOf": [{"$ref": "#/$defs/p"}, {"allOf": [{"type": "null"}]}]},
    {"type": "number", "minimum": -2.5, "exclusiveMaximum": 7, "title": "t", "description": "d", "default": 0},
    True,
]


def _matcher(schema: object) -> xgr.GrammarMatcher:
    """A matcher that ends at the end of the input, over a vocabulary of single bytes: enough to match strings."""
    info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[256])
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(schema))
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)


def _matches(schema: object, text: str) -> bool:
    matcher = _matcher(schema)
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize("schema,keyword,instance", IGNORED, ids=[kw for _, kw, _ in IGNORED])
def test_ignored_keyword_is_named(schema: dict, keyword: str, instance: str) -> None:
    problems = unsupported_keywords(schema)
    assert ("", keyword) in [(path, kw) for path, kw, _ in problems]
    with pytest.raises(StructuredOutputError, match=re.escape(f"'{keyword}' at / (")):
        check_schema_supported(schema)


@pytest.mark.parametrize("schema,keyword,instance", IGNORED, ids=[kw for _, kw, _ in IGNORED])
def test_canary_xgrammar_still_ignores_it(schema: dict, keyword: str, instance: str) -> None:
    # The instance breaks the schema (by the keyword), yet xgrammar's grammar matches it: the keyword is not
    # enforced. When a new xgrammar enforces it, this fails: drop the rule from schema_support.
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert not validator.is_valid(json.loads(instance))
    assert _matches(schema, instance)


def test_nested_keywords_are_named_by_json_pointer() -> None:
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "a/b": {"anyOf": [{"type": "null"}, {"not": {"type": "null"}}]}},
        "$defs": {"x~y": {"type": "string", "format": "phone"}}}
    found = {(path, kw) for path, kw, _ in unsupported_keywords(schema)}
    assert found == {("/properties/tags", "uniqueItems"), ("/properties/a~1b/anyOf/1", "not"),
                     ("/$defs/x~0y", "format")}
    with pytest.raises(StructuredOutputError, match="'uniqueItems' at /properties/tags .*'format' at /\\$defs/x~0y "
                                                    "\\(format 'phone' is not compiled"):
        check_schema_supported(schema)


@pytest.mark.parametrize("schema", SUPPORTED)
def test_supported_schemas_pass(schema: object) -> None:
    assert unsupported_keywords(schema) == []
    check_schema_supported(schema)
    _matcher(rewrite_for_xgrammar(schema))  # and xgrammar compiles them


def test_canary_length_bounded_strings_let_control_characters_in() -> None:
    # xgrammar issue #800: when this fails, xgrammar is fixed and rewrite_for_xgrammar can go
    assert _matches({"type": "string", "maxLength": 5}, '"a\tb"')


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 5}, {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "object", "properties": {"k": {"type": "string", "minLength": 3}}, "required": ["k"]},
    {"type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"maxLength": 3}},
])
def test_rewritten_length_bounds_keep_lengths_and_stay_json(schema: dict) -> None:
    rewritten = rewrite_for_xgrammar(schema)
    assert "Length" not in json.dumps(rewritten)
    validator = jsonschema.Draft202012Validator(schema)
    for value in ["", "a", "ab", "abc", "abcd", "abcde", "abcdef", "a\tb", "ab\x01"]:
        text = json.dumps(value) if "properties" not in schema else json.dumps({"k": value})
        if "propertyNames" in schema:
            text = json.dumps({value: 1})
        raw = text.replace("\\t", "\t").replace("\\u0001", "\x01")  # the raw control characters, which JSON forbids
        assert not _matches(rewritten, raw) or raw == text
        assert _matches(rewritten, text) == (validator.is_valid(json.loads(text)) and text == raw)


def test_malformed_length_bounds_are_left_for_xgrammar_to_name() -> None:
    for schema in ({"type": "string", "maxLength": "3"}, {"type": "string", "minLength": 5, "maxLength": 2}):
        assert rewrite_for_xgrammar(schema) == schema
