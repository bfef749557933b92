"""DSpark drafting for requests with structured outputs: drafts proposed under the grammar's masks and never past
its end, verified under a mask row per position, the matcher taking rejected drafts back; output identical to
decoding without drafts, and valid."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.default_model import default_model, trained_model
from deepinfer.structured_outputs.bitmask import allocate_bitmask, unpack_bitmask
from deepinfer.structured_outputs.compiler import GrammarCompiler
from deepinfer.structured_outputs.matcher import RequestMatcher
from deepinfer.structured_outputs.tokenizer_info import build_tokenizer_info
from tests.test_dspark import tokens_per_verifying_step

DRAFTING = {"method": "dspark", "num_speculative_tokens": 5}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "size"], "additionalProperties": False}
RETURN = r"    return [a-z_]+\(self(, [a-z]+)*\)\n"
IMPORTS = 'root ::= "import " name ("\\n" "import " name)*\nname ::= [a-z]+'


def _so(**constraint) -> StructuredOutputsParams:
    return StructuredOutputsParams(**constraint)


def _check(text: str, params: SamplingParams) -> None:
    so = params.structured_outputs
    if so.json is not None:
        jsonschema.validate(json.loads(text), so.json)
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), text
    elif so.choice is not None:
        assert text in so.choice


@pytest.fixture(scope="module")
def trained():
    return LLM(trained_model(), max_num_seqs=8), LLM(trained_model(), max_num_seqs=8, speculative_config=DRAFTING)


@pytest.mark.parametrize("drafts", [1, 2, 3])
def test_a_grammar_ending_at_the_last_draft_ends_the_request_there(trained, drafts: int) -> None:
    """Short static blocks often end the grammar at their last draft: that draft is dropped, so the stop token
    is the step's last token and nothing follows it (ignore_eos: only the grammar's end stops the request)."""
    off = trained[0]
    on = LLM(trained_model(), max_num_seqs=8,
             speculative_config={"num_speculative_tokens": drafts, "schedule": "static"})
    prompts = ["def f(x):\n", "class Stack:\n    def pop(self):\n", "def run(self):\n", "import os\n"]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True,
                            structured_outputs=_so(regex=r"( {4}[^\n]{0,70}\n){2}"))
    want, got = off.generate(prompts, params, use_tqdm=False), on.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].finish_reason == "stop"


def test_constrained_drafting_on_the_trained_checkpoint(trained) -> None:
    """Same tokens as without drafts, valid, ended by the grammar (ignore_eos or not), and drafts accepted."""
    off, on = trained
    prompts = ["class Stack:\n    def pop(self):\n", "config = ", "import os\n", "class A:\n    ", "def fib(n):\n"]
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=_so(regex=RETURN)),
              SamplingParams(max_tokens=80, temperature=0.7, seed=4,
                             structured_outputs=_so(json=SCHEMA, disable_any_whitespace=True)),
              SamplingParams(max_tokens=30, temperature=0, structured_outputs=_so(grammar=IMPORTS)),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                             structured_outputs=_so(choice=["def __init__(self):", "def run(self):"])),
              SamplingParams(max_tokens=20, temperature=0)]
    want, got = off.generate(prompts, params, use_tqdm=False), on.generate(prompts, params, use_tqdm=False)
    for w, g, p in zip(want, got, params, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if p.structured_outputs is not None and g.outputs[0].finish_reason == "stop":
            _check(g.outputs[0].text, p)
        assert g.metrics.drafts_verified, "constrained requests draft too"
    assert [g.outputs[0].finish_reason for g in got[:2]] == ["stop", "stop"]
    assert got[3].outputs[0].finish_reason == "stop"  # ignore_eos: the grammar's end still ends it, nothing after
    assert tokens_per_verifying_step(got[:4]) > 1.5  # measured 2.9 tokens per verifying step


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_constrained_drafting_on_random_weights_is_lossless(seed: int) -> None:
    """Random weights on the V4 tokenizer: drafts are mostly rejected, so rows are masked past rejected drafts and
    the matchers take them back; outputs still match decoding without drafts and are valid."""
    model = default_model()
    off, on = LLM(model, max_num_seqs=4), LLM(model, max_num_seqs=4, speculative_config=DRAFTING)
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured_outputs=_so(
                  json=SCHEMA, disable_any_whitespace=True)),
              SamplingParams(max_tokens=30, temperature=1.0, seed=seed + 10,
                             structured_outputs=_so(regex=r"[a-c]{3}-\d{1,3}")),
              SamplingParams(max_tokens=12, temperature=0)]
    prompts = ["a", "b", "c"]
    want, got = off.generate(prompts, params, use_tqdm=False), on.generate(prompts, params, use_tqdm=False)
    for w, g, p in zip(want, got, params, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if p.structured_outputs is not None:
            assert g.outputs[0].finish_reason == "stop"
            _check(g.outputs[0].text, p)


def test_the_mask_after_drafts_ends_at_the_grammar_end_and_at_a_broken_draft() -> None:
    tokenizer = trained_model().tokenizer
    vocab, eos = 8192, 1
    info = build_tokenizer_info(tokenizer, vocab, [eos])
    matcher = RequestMatcher(GrammarCompiler(info).compile(_so(choice=["ab"])))
    a, b = tokenizer.encode("a"), tokenizer.encode("b")
    bitmask = allocate_bitmask(4, vocab)
    assert matcher.fill_after(bitmask, 0, [])
    assert matcher.fill_after(bitmask, 1, a)
    assert matcher.fill_after(bitmask, 2, a + b)  # complete: only eos may follow
    assert not matcher.fill_after(bitmask, 3, a + b + [eos])  # ended: nothing may follow
    allowed = unpack_bitmask(bitmask, vocab)
    assert allowed[0, a[0]] and not allowed[0, b[0]] and allowed[1, b[0]]
    assert torch.nonzero(allowed[2]).flatten().tolist() == [eos]
    assert not allowed[3].any()
    assert not matcher.fill_after(bitmask, 0, b) and not unpack_bitmask(bitmask, vocab)[0].any()  # refused draft
    assert matcher.num_tokens == 0 and not matcher.is_terminated()  # the state is as before every call
    assert matcher.accept(a[0])
