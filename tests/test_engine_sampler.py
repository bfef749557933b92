"""The engine's sampler: each row's token is `sample`'s, alone or batched, masked or not, and a step's plain rows are
drawn in one call."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import sampler as engine_sampler
from deepinfer.engine.sampler import Draw, Sampler, SampleRow
from deepinfer.sampler import sample, top_logprobs
from deepinfer.sampling_params import SamplingParams
from dsl.context import SequenceState

VOCAB, EOS = 300, (2,)
PARAMS = [
    SamplingParams(temperature=0),  # plain greedy
    SamplingParams(temperature=0.7, seed=1),  # plain sampled
    SamplingParams(temperature=1.3, top_p=0.9, seed=2),  # a cut: per row
    SamplingParams(temperature=0.9, presence_penalty=0.8, frequency_penalty=0.3, seed=3),  # penalties: per row
    SamplingParams(temperature=0, logprobs=2),  # log-probabilities: per row
    SamplingParams(temperature=0, min_tokens=9),  # eos still banned: per row
    SamplingParams(temperature=1.0, seed=4),  # plain sampled
    SamplingParams(temperature=0, repetition_penalty=1.3),  # a penalty on a greedy row: per row
]


def step(num_drafts: int = 0, seed: int = 0) -> tuple[torch.Tensor, list[Draw]]:
    """Logits of a step whose rows sample with PARAMS, between rows that do not sample, and its draws."""
    gen = torch.Generator().manual_seed(seed)
    draws, first = [], 1  # logits row 0: a chunk that does not sample
    for i, params in enumerate(PARAMS):
        prompt = torch.randint(3, VOCAB, (4 + i,), generator=gen).tolist()
        outputs = [2, 7, 2] + torch.randint(3, VOCAB, (i,), generator=gen).tolist()  # eos and repeats to penalise
        row = SampleRow(i, str(i), 0, params, 100 + i, prompt, outputs[:-1], 1)
        drafts = torch.randint(3, VOCAB, (num_drafts,), generator=gen).tolist()
        draws.append(Draw(row, outputs, drafts, first, SequenceState()))
        first += 1 + num_drafts + (i % 2)  # every other one followed by a chunk that does not sample
    logits = torch.randn(first, VOCAB, generator=gen) * 3
    logits[:, 2] += 4  # eos likely: the min_tokens ban matters
    return logits, draws


def reference(logits: torch.Tensor, allowed: torch.Tensor | None, d: Draw, k: int = 0) -> tuple[int, dict | None]:
    """`sample` on the draw's logits row k, after its outputs and its first k drafts."""
    s, seen = d.row, d.outputs + d.drafts[:k]
    row = logits[d.first + k]
    masked = row if allowed is None else row.masked_fill(~allowed, float("-inf"))
    token = sample(masked, s.params, s.seed, len(s.prompt_token_ids) + len(seen), seen, s.prompt_token_ids, EOS)
    return token, top_logprobs(row, token, s.params.logprobs) if s.params.logprobs is not None else None


@pytest.mark.parametrize("seed", range(4))
def test_each_token_is_the_samplers_alone(seed: int) -> None:
    logits, draws = step(seed=seed)
    got = Sampler(EOS)(logits, None, draws)
    for d, (tokens, logprobs) in zip(draws, got, strict=True):
        token, want_logprobs = reference(logits, None, d)
        assert tokens == [token] and logprobs == [want_logprobs]


@pytest.mark.parametrize("seed", range(4))
def test_each_masked_token_is_the_samplers_alone(seed: int) -> None:
    logits, draws = step(seed=seed)
    allowed = torch.rand(len(draws), VOCAB, generator=torch.Generator().manual_seed(seed)) < 0.2
    allowed[:, 5] = True
    got = Sampler(EOS)(logits, allowed, draws)
    for j, (d, (tokens, _)) in enumerate(zip(draws, got, strict=True)):
        assert tokens == [reference(logits, allowed[j], d)[0]] and bool(allowed[j, tokens[0]])


def test_plain_rows_are_drawn_in_one_call_for_the_step(monkeypatch) -> None:
    calls = []
    sample_plain = engine_sampler.sample_plain
    monkeypatch.setattr(engine_sampler, "sample_plain", lambda logits, *a: calls.append(len(logits)) or
                        sample_plain(logits, *a))
    logits, draws = step()
    Sampler(EOS)(logits, None, draws)
    assert calls == [len(logits)]  # every logits row at once
    Sampler(EOS)(logits, torch.ones(len(draws), VOCAB, dtype=torch.bool), draws)
    Sampler(EOS)(logits, None, [draws[2], draws[3]])
    assert calls == [len(logits)]  # masks, or no plain row: none


def test_picks_give_every_position_of_a_plain_row_and_none_for_the_others() -> None:
    """With drafts, a plain row's picks are `sample`'s at each of its positions (after the drafts before it)."""
    logits, draws = step(num_drafts=3, seed=7)
    picks = Sampler(EOS).picks(logits, draws)
    plain = [0, 1, 6]
    assert [j for j, p in enumerate(picks) if p is not None] == plain
    for j in plain:
        assert picks[j] == [reference(logits, None, draws[j], k)[0] for k in range(4)]
