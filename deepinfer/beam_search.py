"""Beam search, as vLLM's `LLM.beam_search` runs it: one engine step per token over every live beam.

Each step every live beam is extended by one token with `2 * beam_width` log-probabilities asked for (the model's
raw distribution); each candidate becomes a new beam whose cumulative log-probability adds the candidate's. A
candidate that is an eos token (unless `ignore_eos`) completes its beam; the others compete, and the `beam_width`
best by score stay live. After `max_tokens` steps (or once no beam is live) the completed and live beams are ranked
together and the best `beam_width` returned. The score is cumulative log-probability over length to the power of
`length_penalty`, the length counting the prompt and every token but a final eos (vLLM's, after Hugging Face's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deepinfer.engine.request import RequestError, check_prompt
from deepinfer.inputs import parse_prompt
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.llm import LLM


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam search parameters: `beam_width` beams, at most `max_tokens` generated tokens each."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {lp!r}")
        SamplingParams(temperature=self.temperature)  # the same check as sampling's


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt and the generated tokens; `logprobs` one dict per generated token."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def score(beam: BeamSearchSequence, eos_token_ids: tuple[int, ...], length_penalty: float) -> float:
    """Cumulative log-probability over length ** length_penalty (a final eos not counted)."""
    length = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / max(length, 1) ** length_penalty


def beam_search(llm: LLM, prompts: list[Any], params: BeamSearchParams,
                use_tqdm: bool = False) -> list[BeamSearchOutput]:
    """The beam search of every prompt (strings or prompt dicts) on `llm`'s engine."""
    step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                 ignore_eos=params.ignore_eos, seed=0)
    starts = [_prompt_ids(llm, i, prompt) for i, prompt in enumerate(prompts)]
    eos = () if params.ignore_eos else llm.eos_token_ids
    live = [[BeamSearchSequence(ids)] for ids in starts]
    done: list[list[BeamSearchSequence]] = [[] for _ in starts]
    for _ in range(params.max_tokens):
        beams = [(p, beam) for p, group in enumerate(live) for beam in group
                 if len(beam.tokens) < llm.max_model_len]
        if not beams:
            break
        outs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in beams], step_params, use_tqdm)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in starts]
        for (p, beam), out in zip(beams, outs, strict=True):
            for token, lp in out.outputs[0].logprobs[0].items():
                grown = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [out.outputs[0].logprobs[0]],
                                           beam.cum_logprob + lp.logprob)
                if token in eos:
                    grown.finish_reason, done[p] = "stop", done[p] + [grown]
                else:
                    candidates[p].append(grown)
        live = [sorted(group, key=lambda b: -score(b, eos, params.length_penalty))[: params.beam_width]
                for group in candidates]
    return [_best(llm, len(ids), done[p] + live[p], eos, params) for p, ids in enumerate(starts)]


def _prompt_ids(llm: LLM, i: int, prompt: Any) -> list[int]:
    """A prompt's token ids, checked as the engine checks them; ValueError naming the prompt otherwise."""
    try:
        _, ids = parse_prompt(llm.tokenizer, prompt)
        check_prompt(ids, llm.config.vocab_size, llm.max_model_len)
    except RequestError as e:
        raise ValueError(f"beam search prompt {i}: {e}") from None
    return ids


def _best(llm: LLM, num_prompt: int, beams: list[BeamSearchSequence], eos: tuple[int, ...],
          params: BeamSearchParams) -> BeamSearchOutput:
    """The best `beam_width` beams, each with its text (the generated tokens decoded, a final eos only with
    include_stop_str_in_output) and finish reason ("stop" at eos, else "length")."""
    best = sorted(beams, key=lambda b: -score(b, eos, params.length_penalty))[: params.beam_width]
    for beam in best:
        beam.finish_reason = beam.finish_reason or "length"
        generated = beam.tokens[num_prompt:]
        if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
            generated = generated[:-1]
        beam.text = llm.tokenizer.decode(generated, skip_special_tokens=False)
    return BeamSearchOutput(best)
