"""Constrained generation on the embedded default model (random weights): every completion that ends is valid by an
independent validator (jsonschema, re), over many seeds; seeded sampling is deterministic; hypothesis-made schemas.

The loop below is the engine's, reduced: one batched `compiled.step` per token, the manager's mask on the logits,
`deepinfer.sampler.sample` per row, then `accept`; a row ends when its matcher terminates (eos accepted where the
grammar is complete: finish_reason "stop") or at max_tokens. Random weights ramble, so the constraints bound their
output (string lengths, item counts, compact JSON) and every row must end well before max_tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepinfer
from deepinfer import SamplingParams, StructuredOutputsParams
from deepinfer.default_model import default_model
from deepinfer.sampler import sample
from deepinfer.structured_outputs import StructuredOutputManager
from deepinfer.tokenizer import load_tokenizer

SEEDS = range(5)
MAX_TOKENS = 48
EOS = 1
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}
SCHEMAS = {
    "object": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                                "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]},
    "nested_arrays": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
    "enums": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": [1, 2, 3, None]}}, "required": ["color", "size"]},
    "number_ranges": {"type": "object", "properties": {
        "t": {"type": "number", "minimum": -2.5, "maximum": 7},
        "p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "n": {"type": "integer", "minimum": 10, "maximum": 20}}, "required": ["t", "p", "n"]},
    "any_of": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "string", "maxLength": 4},
                         {"type": "null"}]},
    "ref": {"$defs": {"point": POINT}, "type": "object", "required": ["a", "b"],
            "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}},
}
REGEXES = [r"[a-z]{2,5}-\d{3}", r"(yes|no|maybe)", r"-?\d{1,3}(\.\d{1,2})?", r"[A-Z][a-z]{0,4}@[a-z]{1,4}\.(com|org)"]
# EBNF grammars, each with the Python regex of its language
GRAMMARS = [
    ('root ::= greet " " name "!"\ngreet ::= "hello" | "hi" | "hey"\nname ::= [A-Z] [a-z]{1,6}',
     r"(hello|hi|hey) [A-Z][a-z]{1,6}!"),
    ('root ::= "[" item ("," item){0,3} "]"\nitem ::= [0-9]{1,2} | "true" | "false"',
     r"\[([0-9]{1,2}|true|false)(,([0-9]{1,2}|true|false)){0,3}\]"),
]
CHOICES = ["alpha", "beta", "gamma delta"]

CONSTRAINTS = {f"json:{name}": StructuredOutputsParams(json=schema, disable_any_whitespace=True)
               for name, schema in SCHEMAS.items()}
CONSTRAINTS |= {f"regex:{pattern}": StructuredOutputsParams(regex=pattern) for pattern in REGEXES}
CONSTRAINTS |= {f"grammar:{i}": StructuredOutputsParams(grammar=g) for i, (g, _) in enumerate(GRAMMARS)}
CONSTRAINTS["choice"] = StructuredOutputsParams(choice=CHOICES)


@pytest.fixture(scope="module")
def engine():
    tokenizer = load_tokenizer()
    compiled = deepinfer.compile(default_model(tokenizer=tokenizer), "cpu")
    manager = StructuredOutputManager(tokenizer, compiled.config.vocab_size, compiled.config.eos_token_ids)
    yield tokenizer, compiled, manager
    manager.shutdown()


def generate(engine, rows: list[tuple[str, StructuredOutputsParams, int]]) -> dict[str, list[int]]:
    """Token ids of each row (request id, constraint, seed), sampled from the model under its constraint."""
    tokenizer, compiled, manager = engine
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    for request_id, constraint, _ in rows:
        manager.add_request(request_id, constraint)
    assert all(manager.is_ready(request_id, wait=True) for request_id, _, _ in rows)
    prompt = tokenizer.encode("Answer:")
    states = {request_id: compiled.new_sequence() for request_id, _, _ in rows}
    out: dict[str, list[int]] = {request_id: [] for request_id, _, _ in rows}
    live = [(request_id, seed) for request_id, _, seed in rows]
    logits = compiled.step([(states[r], prompt) for r, _ in live])  # [len(live), vocab]
    while live:
        mask = manager.fill_bitmask([r for r, _ in live])
        manager.apply_bitmask(logits, mask)
        still = []
        for (request_id, seed), row in zip(live, logits):
            tokens = out[request_id]
            token = sample(row, params, seed, len(prompt) + len(tokens), tokens, prompt, (EOS,))
            assert manager.accept(request_id, token), "the sampler drew a token the mask forbids"
            tokens.append(token)
            if not manager.is_terminated(request_id) and len(tokens) < MAX_TOKENS:
                still.append((request_id, seed))
        live = still
        if live:
            logits = compiled.step([(states[r], [out[r][-1]]) for r, _ in live])
    for request_id, _, _ in rows:
        assert manager.is_terminated(request_id), f"{request_id} did not finish in {MAX_TOKENS} tokens"
        manager.remove_request(request_id)
    return out


@pytest.fixture(scope="module")
def completions(engine) -> dict[str, list[str]]:
    """The texts of every constraint under every seed, generated in one batch of len(CONSTRAINTS) * len(SEEDS)."""
    tokenizer = engine[0]
    rows = [(f"{name}#{seed}", constraint, seed) for name, constraint in CONSTRAINTS.items() for seed in SEEDS]
    out = generate(engine, rows)
    texts: dict[str, list[str]] = {name: [] for name in CONSTRAINTS}
    for request_id, tokens in out.items():
        assert tokens[-1] == EOS and EOS not in tokens[:-1]  # it ended by stopping, where the grammar allowed
        texts[request_id.split("#")[0]].append(tokenizer.decode(tokens))
    return texts


@pytest.mark.parametrize("name", SCHEMAS)
def test_json_completions_validate(completions, name: str) -> None:
    validator = jsonschema.Draft202012Validator(SCHEMAS[name])
    for text in completions[f"json:{name}"]:
        validator.validate(json.loads(text))  # strict json.loads: no raw control characters in strings


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_completions_match(completions, pattern: str) -> None:
    for text in completions[f"regex:{pattern}"]:
        assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("index", range(len(GRAMMARS)))
def test_grammar_completions_match(completions, index: int) -> None:
    for text in completions[f"grammar:{index}"]:
        assert re.fullmatch(GRAMMARS[index][1], text), text


def test_choice_completions_are_choices(completions) -> None:
    assert set(completions["choice"]) <= set(CHOICES)


def test_seeds_give_different_completions(completions) -> None:
    for name in ("json:object", "json:nested_arrays", f"regex:{REGEXES[0]}"):
        assert len(set(completions[name])) > 1, name


def test_seeded_constrained_sampling_is_deterministic(engine) -> None:
    rows = [(f"{name}@{seed}", CONSTRAINTS[name], seed) for name in ("grammar:0", "choice") for seed in (3, 4)]
    first = generate(engine, rows)
    again = generate(engine, rows)
    assert first == again


def _schemas(depth: int = 2) -> st.SearchStrategy[dict]:
    """Small JSON schemas whose every instance is short: bounded strings, integers, arrays and objects."""
    low = st.integers(-50, 50)
    leaves = st.one_of(
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.builds(lambda a, d: {"type": "integer", "minimum": a, "maximum": a + d}, low, st.integers(0, 100)),
        st.builds(lambda a, d: {"type": "number", "minimum": a / 2, "maximum": a / 2 + d}, low, st.integers(1, 20)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 5)),
        st.lists(st.one_of(st.integers(-5, 5), st.text("abc", max_size=3), st.none()), min_size=1, max_size=4,
                 unique=True).map(lambda values: {"enum": values}),
    )
    if depth == 0:
        return leaves
    child = _schemas(depth - 1)
    names = st.lists(st.text("xyz", min_size=1, max_size=2), min_size=1, max_size=3, unique=True)
    objects = names.flatmap(lambda keys: st.builds(
        lambda subs, required: {"type": "object", "properties": dict(zip(keys, subs)),
                                "required": [k for k, r in zip(keys, required) if r]},
        st.lists(child, min_size=len(keys), max_size=len(keys)), st.lists(st.booleans(), min_size=len(keys),
                                                                            max_size=len(keys))))
    arrays = st.builds(lambda item, a, d: {"type": "array", "items": item, "minItems": a, "maxItems": a + d},
                       child, st.integers(0, 2), st.integers(0, 2))
    any_of = st.lists(child, min_size=2, max_size=3).map(lambda subs: {"anyOf": subs})
    return st.one_of(leaves, objects, arrays, any_of)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=_schemas(), seed=st.integers(0, 2**32 - 1))
def test_hypothesis_schemas_give_valid_json(engine, schema: dict, seed: int) -> None:
    # Random logits stand in for the model (whose weights are random anyway): what is under test is the mask,
    # the sampler and the matcher on the real tokenizer, over schemas hypothesis makes up.
    tokenizer, _, manager = engine
    manager.add_request("h", StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert manager.is_ready("h", wait=True)
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while not manager.is_terminated("h") and len(tokens) < 4 * MAX_TOKENS:
        logits = torch.randn(1, manager.vocab_size, generator=gen)  # [1, vocab]
        manager.apply_bitmask(logits, manager.fill_bitmask(["h"]))
        token = sample(logits[0], SamplingParams(temperature=0), seed, len(tokens))
        assert manager.accept("h", token)
        tokens.append(token)
    manager.remove_request("h")
    assert tokens[-1] == EOS, f"no end after {len(tokens)} tokens: {tokenizer.decode(tokens)!r}"
    jsonschema.Draft202012Validator(schema).validate(json.loads(tokenizer.decode(tokens)))
