"""Structured outputs: completions constrained to a JSON schema, a regex, an EBNF grammar or a choice (xgrammar).

`StructuredOutputsParams` and `StructuredOutputError` load at once; the rest brings in xgrammar (and through it
transformers, about two seconds), so it loads on first use.
"""

from __future__ import annotations

from deepinfer.structured_outputs.params import StructuredOutputError, StructuredOutputsParams

__all__ = [
    "BatchBitmask", "GrammarCompiler", "RequestMatcher", "StructuredOutputConstraint", "StructuredOutputError",
    "StructuredOutputManager", "StructuredOutputsParams", "allocate_bitmask", "apply_bitmask", "build_tokenizer_info",
]

_LAZY = {  # name -> module of this package
    "BatchBitmask": "manager", "StructuredOutputManager": "manager", "StructuredOutputConstraint": "constraint",
    "GrammarCompiler": "compiler", "RequestMatcher": "matcher", "allocate_bitmask": "bitmask",
    "apply_bitmask": "bitmask", "build_tokenizer_info": "tokenizer_info",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"deepinfer.structured_outputs.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'deepinfer.structured_outputs' has no attribute {name!r}")
