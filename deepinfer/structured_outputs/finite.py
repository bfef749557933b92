"""Whether a grammar matches any finite text at all: a constraint that none does would run every request to max_tokens.

`root ::= "a" root`, or a JSON schema whose required property refers back to the schema itself, has only infinite
"instances": xgrammar compiles it, and a constrained completion can never end. `check_finite` reads the grammar as
xgrammar prints it after normalising (one `name ::= body` per line; bodies of string literals, character classes,
rule names, `Regex(...)` (a JSON string's pattern), groups with `|`, repetitions `{m, n}`, `*`, `+`, `?`, and
lookahead assertions `(= ...)`) and computes
the productive rules, those that derive some finite string, as the least fixed point: a literal or a class is
productive, a sequence when all its parts are, a choice when one branch is, a repetition with a minimum of 0 always.
Lookaheads only narrow what follows, so they are left out (a grammar they make empty is not caught); a printout
with a construct this reader does not know is not judged.
"""

from __future__ import annotations

import re

import xgrammar as xgr

from deepinfer.structured_outputs.params import StructuredOutputError

_TOKEN = re.compile(r'''
    (?P<regex>Regex\("(?:[^"\\]|\\.)*"(?:,\s*\w+=\w+)*\))
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<name>[A-Za-z_][A-Za-z0-9_.\-]*)
  | (?P<look>\(=)
  | (?P<open>\()
  | (?P<close>\))
  | (?P<bar>\|)
  | (?P<range>\{\s*(?P<low>\d+)\s*(?:,\s*-?\d*\s*)?\})
  | (?P<star>[*?])
  | (?P<plus>\+)
  | (?P<space>\s+)
''', re.VERBOSE)

# An expression: ("seq", [items]) | ("alt", [items]) | ("rule", name) | ("term",) | ("opt", item) | ("lookahead",)


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None:
            raise ValueError(f"cannot read the grammar at {body[pos:pos + 20]!r}")
        kind = m.lastgroup
        if kind != "space":
            out.append((kind, m.group("low") if kind == "range" else m.group(0)))
        pos = m.end()
    return out


def _parse(tokens: list[tuple[str, str]], i: int = 0, closing: bool = False) -> tuple[tuple, int]:
    """An alternation of sequences from tokens[i:], up to a closing parenthesis when `closing`."""
    branches, items = [], []
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "close":
            if not closing:
                raise ValueError("unbalanced ')'")
            break
        i += 1
        if kind == "bar":
            branches.append(("seq", items))
            items = []
        elif kind in ("open", "look"):
            inner, i = _parse(tokens, i, closing=True)
            i += 1  # the ')'
            items.append(inner if kind == "open" else ("lookahead",))
        elif kind == "name":
            items.append(("rule", text))
        elif kind in ("string", "cls", "regex"):
            items.append(("term",))
        elif kind == "star" or kind == "range" and int(text) == 0:
            items[-1] = ("opt", items[-1])
        # "+" and a range with a minimum above 0 need their item once: it stays as it is
    branches.append(("seq", items))
    return ("alt", branches), i


def _productive(expr: tuple, known: set[str]) -> bool:
    kind = expr[0]
    if kind in ("term", "opt", "lookahead"):
        return True
    if kind == "rule":
        return expr[1] in known
    if kind == "seq":
        return all(_productive(e, known) for e in expr[1])
    return any(_productive(e, known) for e in expr[1])  # alt


def productive_rules(text: str) -> tuple[set[str], set[str]]:
    """(productive rule names, all rule names) of a grammar in xgrammar's normalised form."""
    rules = {}
    for line in text.splitlines():
        if "::=" in line:
            name, _, body = line.partition("::=")
            rules[name.strip()], _ = _parse(_tokens(body))
    known: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if name not in known and _productive(expr, known):
                known.add(name)
                changed = True
    return known, set(rules)


def check_finite(grammar: xgr.Grammar, what: str) -> None:
    """Raise StructuredOutputError when no finite text matches `grammar` (its root rule is not productive)."""
    try:
        known, names = productive_rules(str(grammar))
    except ValueError:  # a construct of xgrammar's printout this reader does not know: not judged
        return
    if "root" in names and "root" not in known:
        raise StructuredOutputError(f"the {what} matches no finite text (every match would go on forever): a "
                                    "constrained completion could never end")
