"""What a request asks its output to match (vLLM's `StructuredOutputsParams`), and the error when it cannot be honoured.

This file stays free of xgrammar so that `SamplingParams` imports fast: it checks the shape of a request (exactly one
constraint, of the right type, a schema that parses); whether xgrammar can compile it is decided by the compiler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any

KINDS = ("json", "regex", "grammar", "choice")


class StructuredOutputError(ValueError):
    """A constraint that cannot be honoured: an invalid schema, regex or grammar, a schema keyword xgrammar does not
    enforce, or a compilation past its time limit. It fails that request alone (finish_reason "error")."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a completion, with vLLM's names: exactly one of

    `json`: a JSON schema (a dict, or its text); `regex`: a pattern the whole completion matches; `grammar`: an EBNF
    grammar in xgrammar's GBNF dialect (llama.cpp's), whose start rule is `root`; `choice`: a list of strings, one
    of which is the completion. `disable_any_whitespace` (json only) forbids whitespace between JSON tokens, as in
    vLLM: outputs are compact, and a model cannot spend its tokens on blank space.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            got = " and ".join(given) if given else "none"
            raise StructuredOutputError(f"structured_outputs takes exactly one of json, regex, grammar, choice; "
                                        f"got {got}")
        if self.json is not None:
            self.key  # parses and re-serialises the schema now, so a malformed one fails here  # noqa: B018
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputError(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice \
                    or not all(isinstance(c, str) for c in self.choice):
                raise StructuredOutputError(f"structured_outputs.choice must be a non-empty list of strings, "
                                            f"got {self.choice!r}")
            object.__setattr__(self, "choice", list(self.choice))
        if not isinstance(self.disable_any_whitespace, bool):
            raise StructuredOutputError(f"structured_outputs.disable_any_whitespace must be True or False, "
                                        f"got {self.disable_any_whitespace!r}")

    @cached_property
    def _schema(self) -> dict[str, Any] | bool:
        schema = self.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(f"structured_outputs.json must be a JSON schema (an object, or its text), "
                                        f"got {type(schema).__name__}")
        return schema

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "grammar" or "choice"."""
        return next(kind for kind in KINDS if getattr(self, kind) is not None)

    @property
    def schema(self) -> dict[str, Any] | bool:
        """The JSON schema as a Python object (json only)."""
        if self.json is None:
            raise AttributeError("schema: these structured_outputs are not a JSON schema")
        return self._schema

    @cached_property
    def key(self) -> tuple[str, str, bool]:
        """(kind, text, disable_any_whitespace): two requests with equal keys share one compiled grammar.

        A schema's text is re-serialised, so formatting differences share an entry; its key order is kept, since
        xgrammar emits object properties in the order the schema declares them.
        """
        if self.json is not None:
            try:
                text = json.dumps(self._schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise StructuredOutputError(f"structured_outputs.json is not serialisable as JSON: {e}") from None
            return ("json", text, self.disable_any_whitespace)
        if self.choice is not None:
            return ("choice", json.dumps(self.choice, ensure_ascii=False), False)
        return (self.kind, getattr(self, self.kind), False)
