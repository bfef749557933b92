"""A JSON schema's instances as xgrammar would let them through, made to be the schema's own.

xgrammar (0.2.9) compiles `enum` and `const` into their listed values and nothing else: the keywords beside them
(`"type": "string"` beside `"enum": [1, "a"]`, a `maximum`, a `minLength`) are dropped, so a completion can end
("stop") on a value the schema refuses. It also ignores a `required` name that `properties` does not list, and
compiles an empty `anyOf` into the empty string. So, before compiling:

- `check_values` names a keyword whose value is malformed (a negative `minLength`, a `format` that is not a string)
  where xgrammar would fail with an internal message or not at all;
- `restrict_values` keeps of each `enum` / `const` the values that satisfy the keywords beside them, and refuses the
  schema when none does; keywords beside them that it cannot evaluate are reported by `sibling_problems`;
- `list_required` adds each required name that `properties` lacks to `properties` (with the `additionalProperties`
  schema, or any value), so xgrammar asks for it, and refuses the schema when `additionalProperties` forbids it.
A schema none of whose instances is finite (a required property referring back to the schema) is refused after
compiling to a grammar (finite.py).
"""

from __future__ import annotations

import math
import re
from typing import Any

from deepinfer.structured_outputs.params import StructuredOutputError

_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# Keywords beside enum/const that `_satisfies` evaluates, and those that assert nothing.
_EVALUATED = frozenset({"type", "multipleOf", "pattern", "required", *_COUNTS, *_BOUNDS})
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$id", "$schema", "$anchor",
                          "deprecated", "readOnly", "writeOnly", "$defs", "definitions", "enum", "const"})


def check_values(path: str, node: dict[str, Any]) -> None:
    """Raise StructuredOutputError naming the first malformed keyword value of this schema object."""
    where = path or "/"
    for keyword in _COUNTS:
        value = node.get(keyword, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StructuredOutputError(f"invalid JSON schema: '{keyword}' at {where} must be a non-negative "
                                        f"integer, got {value!r}")
    for keyword in ("format", "pattern"):
        if keyword in node and not isinstance(node[keyword], str):
            raise StructuredOutputError(f"invalid JSON schema: '{keyword}' at {where} must be a string, "
                                        f"got {node[keyword]!r}")
    for keyword in ("anyOf", "oneOf", "allOf"):
        if keyword in node and (not isinstance(node[keyword], list) or not node[keyword]):
            raise StructuredOutputError(f"invalid JSON schema: '{keyword}' at {where} must be a non-empty list of "
                                        f"schemas (an empty one admits no value), got {node[keyword]!r}")


def sibling_problems(node: dict[str, Any]) -> list[tuple[str, str]]:
    """(keyword, why) for keywords beside enum/const that xgrammar drops and `restrict_values` cannot apply."""
    if "enum" not in node and "const" not in node:
        return []
    why = ("xgrammar enforces only the listed enum/const values, and this keyword beside them cannot be applied to "
           "them here; list only values that satisfy it")
    return [(keyword, why) for keyword in node if keyword not in _EVALUATED and keyword not in _ANNOTATIONS]


def restrict_values(path: str, node: dict[str, Any]) -> None:
    """Keep of `enum` / `const` only the values the keywords beside them admit (as `enum`); raise when none is."""
    if "enum" not in node and "const" not in node:
        return
    values = list(node["enum"]) if isinstance(node.get("enum"), list) else None
    if "const" in node:
        values = [v for v in (values if values is not None else [node["const"]]) if _equal(v, node["const"])]
    if values is None:
        return  # a malformed enum: xgrammar names it
    kept = [v for v in values if _satisfies(v, node)]
    if not kept:
        raise StructuredOutputError(f"the JSON schema admits no value at {path or '/'}: none of its enum/const values "
                                    "satisfies the keywords beside them")
    node.pop("const", None)
    node["enum"] = kept


def list_required(path: str, node: dict[str, Any]) -> None:
    """Add each required name that `properties` lacks to `properties`; raise when additionalProperties forbids it."""
    required = node.get("required")
    if not isinstance(required, list) or "enum" in node or not (node.get("type") == "object" or "properties" in node):
        return
    properties = node.setdefault("properties", {})
    if not isinstance(properties, dict):
        return  # xgrammar names it
    extra = node.get("additionalProperties", True)
    for name in required:
        if not isinstance(name, str) or name in properties:
            continue
        if any(isinstance(p, str) and re.search(p, name) for p in node.get("patternProperties") or {}):
            raise StructuredOutputError(f"the JSON schema requires {name!r} at {path or '/'} through "
                                        "patternProperties, which xgrammar does not enforce for required names; "
                                        "list it under properties")
        if extra is False:
            raise StructuredOutputError(f"the JSON schema admits no value at {path or '/'}: it requires {name!r}, "
                                        "which is not among its properties while additionalProperties is false")
        properties[name] = extra if isinstance(extra, dict) else {}


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b and type(a) in (int, float, str, type(None)) and type(b) in (int, float, str, type(None))


def _json_type(value: Any) -> set[str]:
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, (int, float)):
        return {"number", "integer"} if float(value).is_integer() else {"number"}
    return {str: {"string"}, list: {"array"}, dict: {"object"}}.get(type(value), set())


def _satisfies(value: Any, node: dict[str, Any]) -> bool:
    """Whether `value` meets the keywords of `_EVALUATED` in `node` (each applies to its own type only)."""
    types = node.get("type")
    if types is not None and not _json_type(value) & set(types if isinstance(types, list) else [types]):
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low, high = node.get("minimum", -math.inf), node.get("maximum", math.inf)
        if value < low or value > high:
            return False
        if value <= node.get("exclusiveMinimum", -math.inf) or value >= node.get("exclusiveMaximum", math.inf):
            return False
        step = node.get("multipleOf")
        if isinstance(step, (int, float)) and step > 0 and not float(value / step).is_integer():
            return False
    sized = {str: ("minLength", "maxLength"), list: ("minItems", "maxItems"), dict: ("minProperties", "maxProperties")}
    if type(value) in sized:
        low, high = sized[type(value)]
        if not node.get(low, 0) <= len(value) <= node.get(high, math.inf):
            return False
    if isinstance(value, str) and isinstance(node.get("pattern"), str):
        try:
            if re.search(node["pattern"], value) is None:
                return False
        except re.error:
            pass  # xgrammar names a pattern it cannot read
    return not (isinstance(value, dict) and any(name not in value for name in node.get("required", ())))
