"""A vLLM user's script with `vllm` changed to `deepinfer`: its calls run on the embedded model, with vLLM's shapes
and conventions (the sampled token first among log-probabilities, -1 for the whole vocabulary, beam search's
ordering, chat through the tokenizer's template)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from deepinfer import (
    LLM,
    BeamSearchParams,
    CompletionOutput,
    EngineArgs,
    RequestOutput,
    SamplingParams,
    TextPrompt,
    TokensPrompt,
    default_checkpoint,
)

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPT = "def fib(n):"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**dataclasses.asdict(EngineArgs(max_num_seqs=8)))  # vLLM's `LLM(**asdict(engine_args))`


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> CompletionOutput:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0]


def test_chat_takes_a_conversation_or_a_list_of_them(llm: LLM) -> None:
    outs = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)
    assert len(outs) == 1 and isinstance(outs[0], RequestOutput) and isinstance(outs[0].outputs[0], CompletionOutput)
    assert outs[0].prompt == "<|bos|><｜User｜>hi<｜Assistant｜></think>" and len(outs[0].outputs[0].token_ids) == 8
    conversations = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}],
                     [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]]
    two = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert two[0].prompt == ("<|bos|>Be brief.<｜User｜>hi<｜Assistant｜></think>hello<|eos|>"
                             "<｜User｜>more<｜Assistant｜></think>")
    assert two[1].outputs[0].token_ids == outs[0].outputs[0].token_ids  # content parts join into the same text
    own = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, add_generation_prompt=False,
                   chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert own[0].prompt == "[hi]"
    bad = llm.chat([[{"role": "user", "content": "ok"}], [{"role": "robot", "content": "x"}]], GREEDY, use_tqdm=False)
    assert bad[0].error is None and "role 'robot' is not one of" in bad[1].error  # a bad conversation fails alone


def test_the_tokenizer_is_transformers_own_over_the_same_file(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast) and len(tok) == llm.config.vocab_size == len(tok.get_vocab())
    ids = llm.tokenizer.encode(PROMPT)
    assert tok(PROMPT, add_special_tokens=False)["input_ids"] == ids and tok.decode(ids) == PROMPT
    assert tok.batch_decode([ids, ids[:2]]) == [PROMPT, llm.tokenizer.decode(ids[:2])]
    assert tok.convert_ids_to_tokens(ids) == [llm.tokenizer.id_to_token(i) for i in ids]
    assert tok.eos_token == "<|eos|>" and tok.eos_token_id == 1
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == llm.chat(messages, GREEDY, use_tqdm=False)[0].prompt


def test_tokens_and_text_prompts(llm: LLM, greedy: CompletionOutput) -> None:
    ids = llm.tokenizer.encode(PROMPT)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids), TextPrompt(prompt=PROMPT), PROMPT], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [greedy.token_ids] * 3
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == ids and outs[1].prompt == PROMPT


def test_logprobs_put_the_sampled_token_first_and_minus_one_is_the_vocabulary(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=3)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    full = llm.generate(PROMPT, dataclasses.replace(params, logprobs=-1), use_tqdm=False)[0].outputs[0]
    assert full.token_ids == out.token_ids and len(out.logprobs) == 6
    for token, step, whole in zip(out.token_ids, out.logprobs, full.logprobs, strict=True):
        assert next(iter(step)) == token and next(iter(whole)) == token  # the sampled token first, as vLLM
        others = [lp.rank for tid, lp in step.items() if tid != token]
        assert others == sorted(others) and set(others) <= {1, 2, 3} and len(step) in (3, 4)
        assert len(whole) == llm.config.vocab_size
        assert math.isclose(sum(math.exp(lp.logprob) for lp in whole.values()), 1.0, rel_tol=1e-4)
        assert step[token].logprob == whole[token].logprob and step[token].rank == whole[token].rank
    assert out.cumulative_logprob == pytest.approx(sum(s[t].logprob for t, s in zip(out.token_ids, out.logprobs)))


def test_prompt_logprobs_score_each_prompt_token(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    logits = llm.compiled.forward(torch.tensor([ids]))[0]  # [T, V]
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        assert next(iter(entry)) == ids[p] and 2 <= len(entry) <= 3
        expected = torch.log_softmax(logits[p - 1], dim=-1)[ids[p]]
        assert entry[ids[p]].logprob == pytest.approx(float(expected), abs=1e-5)
    assert llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].prompt_logprobs is None


def test_logit_bias_allowed_token_ids_and_bad_words(llm: LLM, greedy: CompletionOutput) -> None:
    first = greedy.token_ids[0]
    pushed = llm.generate(PROMPT, dataclasses.replace(GREEDY, logit_bias={5: 100.0}), use_tqdm=False)[0]
    assert pushed.outputs[0].token_ids == [5] * 8
    pulled = llm.generate(PROMPT, dataclasses.replace(GREEDY, logit_bias={first: -100}), use_tqdm=False)[0]
    assert pulled.outputs[0].token_ids[0] != first
    allowed = llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                                  allowed_token_ids=[40, 41, 42]), use_tqdm=False)[0]
    assert set(allowed.outputs[0].token_ids) <= {40, 41, 42}
    word = "return"
    assert word in greedy.text
    banned = llm.generate(PROMPT, dataclasses.replace(GREEDY, bad_words=[word]), use_tqdm=False)[0].outputs[0]
    assert word not in banned.text and banned.token_ids != greedy.token_ids
    bad = llm.generate([PROMPT, PROMPT], [SamplingParams(logit_bias={10**6: 1.0}), GREEDY], use_tqdm=False)
    assert "logit_bias holds token id 1000000, outside the vocabulary" in bad[0].error and bad[1].error is None


def test_processed_requests_do_not_depend_on_their_batch(llm: LLM) -> None:
    params = [SamplingParams(temperature=0.9, seed=s, max_tokens=10, bad_words=["return"], logit_bias={5: 2.0})
              for s in range(3)]
    batch = llm.generate([PROMPT, "import os", "class A:"], params, use_tqdm=False)
    alone = [llm.generate(p, q, use_tqdm=False)[0] for p, q in zip([PROMPT, "import os", "class A:"], params)]
    assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]


def test_beam_search(llm: LLM, greedy: CompletionOutput) -> None:
    one = llm.beam_search([{"prompt": PROMPT}], BeamSearchParams(beam_width=1, max_tokens=8))[0].sequences
    ids = llm.tokenizer.encode(PROMPT)
    assert len(one) == 1 and one[0].tokens == ids + greedy.token_ids  # width 1 is greedy
    beams = llm.beam_search([TextPrompt(prompt=PROMPT), PROMPT], BeamSearchParams(beam_width=3, max_tokens=5))
    assert len(beams) == 2 and [b.tokens for b in beams[0].sequences] == [b.tokens for b in beams[1].sequences]
    scores = [b.cum_logprob / len(b.tokens) for b in beams[0].sequences]
    assert len(scores) == 3 and scores == sorted(scores, reverse=True)
    for beam in beams[0].sequences:
        generated = beam.tokens[len(ids):]
        assert len(generated) == 5 and beam.finish_reason == "length"
        assert beam.cum_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(generated, beam.logprobs)))
        assert beam.text == llm.tokenizer.decode(generated, skip_special_tokens=False)
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)


def test_default_sampling_params_come_from_generation_config(tmp_path: Path, llm: LLM) -> None:
    assert llm.get_default_sampling_params() == SamplingParams()
    checkpoint = tmp_path / "model"
    checkpoint.mkdir()
    for f in default_checkpoint().iterdir():
        (checkpoint / f.name).symlink_to(f)
    (checkpoint / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95,
                                                                   "max_new_tokens": 5, "do_sample": True}))
    tuned = LLM(str(checkpoint), max_num_seqs=2)
    assert tuned.get_default_sampling_params() == SamplingParams(temperature=0.6, top_p=0.95, max_tokens=5)
    out = tuned.generate(PROMPT, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) <= 5  # generate() without params uses them
