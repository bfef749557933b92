"""What xgrammar enforces of a JSON schema: a check naming what it would ignore, a rewrite around what it gets wrong.

xgrammar (0.2.9) compiles some keywords into nothing, with at most a log line: a completion could then break the
schema while looking constrained. Each rule below was found by compiling a schema and matching an instance that
breaks the keyword; tests/test_structured_outputs_schema.py re-checks that xgrammar still lets it through, so a rule
that a newer xgrammar makes unnecessary fails a test instead of rejecting schemas for nothing. Keywords JSON Schema
does not define (a typo such as "maxItem") assert nothing, for xgrammar as for any validator, and pass.

It also compiles a string's minLength/maxLength into a character class that lets raw control characters (a tab)
into the string, which is not JSON (xgrammar issue #800). Its `pattern` path handles JSON strings correctly, so
length bounds are rewritten into a pattern of the same lengths before compiling. What it gets wrong about enum,
const and required, and malformed keyword values, are in schema_instances.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from deepinfer.structured_outputs.params import StructuredOutputError
from deepinfer.structured_outputs.schema_instances import check_values, list_required, restrict_values, sibling_problems

# Keywords that assert something xgrammar does not compile at all.
IGNORED_KEYWORDS = {
    "not": "negation is not compiled",
    "if": "conditionals are not compiled", "then": "conditionals are not compiled",
    "else": "conditionals are not compiled",
    "dependentRequired": "property dependencies are not compiled",
    "dependentSchemas": "property dependencies are not compiled",
    "dependencies": "property dependencies are not compiled",
    "contains": "contains is not compiled", "minContains": "contains is not compiled",
    "maxContains": "contains is not compiled",
    "$dynamicRef": "dynamic references are not resolved", "$recursiveRef": "recursive references are not resolved",
}
# String formats xgrammar compiles into a pattern; any other format is dropped.
SUPPORTED_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri", "uri-reference",
    "uri-template", "json-pointer", "relative-json-pointer",
})
# xgrammar enumerates a bounded integer range with multipleOf only up to this width, and drops multipleOf past it.
MULTIPLE_OF_MAX_RANGE = 10000
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas: where the walk descends.
_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SCHEMA_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")


def check_schema_supported(schema: Any) -> None:
    """Raise StructuredOutputError naming a malformed keyword value, or every keyword (and where) that xgrammar would
    not enforce."""
    for path, node in _nodes(schema, ""):
        check_values(path, node)
    problems = unsupported_keywords(schema)
    if problems:
        listed = "; ".join(f"'{keyword}' at {path or '/'} ({why})" for path, keyword, why in problems)
        raise StructuredOutputError(f"the JSON schema uses what xgrammar cannot enforce: {listed}")


def unsupported_keywords(schema: Any) -> list[tuple[str, str, str]]:
    """(JSON pointer, keyword, why) for every keyword of `schema` and its subschemas that xgrammar would ignore."""
    return [(path, keyword, why) for path, node in _nodes(schema, "") for keyword, why in _node_problems(node)]


def rewrite_for_xgrammar(schema: Any) -> Any:
    """A copy of `schema` where each string's minLength/maxLength (without a pattern or format) became the pattern
    `^.{min,max}$`: xgrammar's JSON-string-aware regex path compiles it to strings of those lengths (spelled without
    escapes, a subset of the valid ones) and never lets a raw control character in; enum/const values kept only where
    the keywords beside them admit them, and required names listed under properties (schema_instances.py). Raises
    StructuredOutputError when that leaves the schema no value."""
    schema = copy.deepcopy(schema)
    for path, node in _nodes(schema, ""):
        restrict_values(path, node)
        list_required(path, node)
        low, high = node.get("minLength", 0), node.get("maxLength", "")
        if ("minLength" in node or "maxLength" in node) and "pattern" not in node and "format" not in node \
                and _is_count(low) and (high == "" or _is_count(high) and low <= high):  # else xgrammar names them
            node.pop("minLength", None)
            node.pop("maxLength", None)
            node["pattern"] = f"^.{{{low},{high}}}$"
    return schema


def _nodes(schema: Any, path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(JSON pointer, schema object) for `schema` and every subschema below it, parents first."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for keyword in _SCHEMA:
        yield from _nodes(schema.get(keyword), f"{path}/{keyword}")
    for keyword in _SCHEMA_LIST:
        value = schema.get(keyword)
        for i, sub in enumerate(value if isinstance(value, list) else []):
            yield from _nodes(sub, f"{path}/{keyword}/{i}")
    for keyword in _SCHEMA_MAP:
        value = schema.get(keyword)
        for name, sub in (value.items() if isinstance(value, dict) else []):
            yield from _nodes(sub, f"{path}/{keyword}/{_escape(name)}")


def _node_problems(node: dict[str, Any]) -> list[tuple[str, str]]:
    """(keyword, why) for this schema object alone."""
    problems = [(keyword, why) for keyword, why in IGNORED_KEYWORDS.items() if keyword in node]
    problems += sibling_problems(node)
    if node.get("uniqueItems") is True:
        problems.append(("uniqueItems", "uniqueness is not compiled"))
    if "format" in node and node["format"] not in SUPPORTED_FORMATS:
        supported = ", ".join(sorted(SUPPORTED_FORMATS))
        problems.append(("format", f"format {node['format']!r} is not compiled; supported: {supported}"))
    shaped_by = "format" if "format" in node else "pattern" if "pattern" in node else None
    if shaped_by == "format" and "pattern" in node:
        problems.append(("pattern", "a string with a format ignores its pattern"))
    for keyword in ("minLength", "maxLength"):
        if shaped_by and keyword in node:
            problems.append((keyword, f"a string with a {shaped_by} ignores its length bounds"))
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        problems.append(("allOf", "allOf of several schemas compiles to any JSON value"))
    if isinstance(node.get("oneOf"), list) and not _disjoint_by_type(node["oneOf"]):
        problems.append(("oneOf", "branches that are not of distinct types are enforced as anyOf; use anyOf"))
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        problems.append(("$ref", f"only references inside the schema ('#...') resolve, got {ref!r}"))
    if "multipleOf" in node:
        why = _multiple_of_problem(node)
        if why:
            problems.append(("multipleOf", why))
    return problems


def _disjoint_by_type(branches: list[Any]) -> bool:
    """True when every branch declares one JSON type and no two share one: then oneOf equals anyOf."""
    types = [b.get("type") if isinstance(b, dict) else None for b in branches]
    if not all(isinstance(t, str) for t in types) or len(set(types)) != len(types):
        return False
    return not {"integer", "number"} <= set(types)  # every integer is also a number


def _multiple_of_problem(node: dict[str, Any]) -> str | None:
    if node.get("type") != "integer" or not _is_int(node["multipleOf"]):
        return "multipleOf is compiled only for type integer with an integer divisor"
    low = [node[k] for k in ("minimum", "exclusiveMinimum") if k in node]
    high = [node[k] for k in ("maximum", "exclusiveMaximum") if k in node]
    if bool(low) != bool(high):
        return "multipleOf with only one bound is not compiled; give both bounds or neither"
    if low and all(isinstance(v, (int, float)) for v in low + high) and min(high) - max(low) > MULTIPLE_OF_MAX_RANGE:
        return f"multipleOf over a range wider than {MULTIPLE_OF_MAX_RANGE} is not compiled"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _escape(name: str) -> str:
    """A property name as one JSON-pointer segment (RFC 6901)."""
    return str(name).replace("~", "~0").replace("/", "~1")
