"""`LLM`: the offline entry point, as in vLLM: load and compile a model once, then `generate` completions.

For now `generate` runs requests one after another (a request's `n` samples share each forward); the engine
with continuous batching replaces the loop, not the interface.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch
from tqdm import tqdm

from deepinfer.compile import compile as compile_model
from deepinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from deepinfer.sampler import derive_seed, sample, top_logprobs
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | dict[str, Any]


class RequestError(ValueError):
    """A request that cannot run (empty, a token outside the vocabulary, too long): it fails alone."""


@dataclass
class _Sample:
    """One of a request's `n` samples while it is generated."""

    index: int
    seed: int
    state: Any
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class LLM:
    """Generate completions with DeepSeek-V4.1-Flash.

    `model` is a checkpoint directory (config.json and safetensors), or None for the embedded default (a small
    model with random weights, for trying the engine anywhere). `target` is the compile target ("cpu" runs
    anywhere). `seed` seeds the draw of a seed for each request that brings none, so a script's output is
    reproducible. `max_model_len` bounds prompt plus completion (default: the config's max_position_embeddings).
    `tokenizer` is a directory holding tokenizer.json (default: the model's, else the V4 tokenizer).
    """

    def __init__(self, model: str | None = None, target: str = "cpu", seed: int = 0, max_model_len: int | None = None,
                 tokenizer: str | None = None, **kwargs: Any) -> None:
        from deepinfer.models import DeepseekV41Flash

        if kwargs:
            logger.warning("ignoring engine arguments that DeepInfer does not have: %s", ", ".join(sorted(kwargs)))
        self.tokenizer = load_tokenizer(tokenizer or model)
        if model is None:
            from deepinfer.default_model import RANDOM_WEIGHTS_WARNING, default_model

            logger.warning(RANDOM_WEIGHTS_WARNING)
            network = default_model(tokenizer=self.tokenizer)
        else:
            network = DeepseekV41Flash.from_pretrained(model)
            network.tokenizer = self.tokenizer  # Engram's token map must come from the tokenizer prompts go through
        self.config = network.config
        self.compiled = compile_model(network, target=target)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2 (a prompt token and a completion token), "
                             f"got {max_model_len}")
        eos = self.config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(t for t in eos if t is not None and 0 <= t < self.config.vocab_size)
        self._seeds = random.Random(seed)
        self._request_ids = count()

    def get_tokenizer(self):
        """The tokenizer used for prompts and completions."""
        return self.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; results in input order.

        A prompt is a string, `{"prompt": str}` or `{"prompt_token_ids": list[int]}`. `sampling_params` is one
        SamplingParams for all prompts or one per prompt (default: SamplingParams()). A request that cannot run
        comes back with `error` set and finish_reason "error"; the others are not affected.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts: pass one, "
                                 "or one per prompt")
        arrival = time.time()
        # Seeds are drawn at submission, in input order, so they do not depend on how requests are run.
        seeds = [p.seed if p.seed is not None else self._seeds.getrandbits(63) for p in params_list]
        outputs = []
        with tqdm(total=len(prompts), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
            for prompt, params, seed in zip(prompts, params_list, seeds):
                outputs.append(self._run(str(next(self._request_ids)), prompt, params, seed, arrival))
                bar.update(1)
        return outputs

    def _run(self, request_id: str, prompt: PromptType, params: SamplingParams, seed: int,
             arrival: float) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=arrival, first_scheduled_time=time.time())
        text, ids = None, []
        try:
            text, ids = self._tokenize(prompt)
            self._check_prompt(ids)
            samples = self._generate(ids, params, seed, metrics)
            error = None
        except RequestError as e:
            logger.warning("request %s failed: %s", request_id, e)
            samples, error = [], str(e)
        except Exception as e:  # a failure inside the model must not take the other requests down
            logger.exception("request %s failed", request_id)
            samples, error = [], f"{type(e).__name__}: {e}"
        metrics.finished_time = time.time()
        if error is not None:
            samples = [_Sample(index=i, seed=derive_seed(seed, i), state=None, finish_reason="error")
                       for i in range(params.n)]
        outputs = [CompletionOutput(index=s.index, text=s.text, token_ids=s.token_ids,
                                    cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                                    finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in samples]
        return RequestOutput(request_id=request_id, prompt=text, prompt_token_ids=ids, outputs=outputs,
                             finished=True, metrics=metrics, error=error, seed=seed)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            text, ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, ids = prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
        else:
            raise RequestError(f"a prompt is a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}; "
                               f"got {type(prompt).__name__}")
        return text, ids

    def _check_prompt(self, ids: list[int]) -> None:
        vocab = self.config.vocab_size
        if not ids:
            raise RequestError("the prompt is empty: it needs at least one token")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens, which leaves no room to generate within "
                               f"max_model_len={self.max_model_len}")

    def _generate(self, ids: list[int], params: SamplingParams, seed: int, metrics: RequestMetrics) -> list[_Sample]:
        samples = [_Sample(index=i, seed=derive_seed(seed, i), state=self.compiled.new_sequence())
                   for i in range(params.n)]
        if params.logprobs is not None:
            for s in samples:
                s.logprobs, s.cumulative_logprob = [], 0.0
        running = samples
        logits = self.compiled.step([(s.state, ids) for s in running])  # [n, vocab]: the prompt, once per sample
        while running:
            for s, row in zip(running, logits):
                self._append(s, row, ids, params)
            metrics.num_generated_tokens += len(running)
            if metrics.first_token_time is None:
                metrics.first_token_time = time.time()
            running = [s for s in running if s.finish_reason is None]
            if running:
                logits = self.compiled.step([(s.state, [s.token_ids[-1]]) for s in running])
        return samples

    def _append(self, s: _Sample, logits: torch.Tensor, prompt_ids: list[int], params: SamplingParams) -> None:
        """Sample the next token of `s` from its logits [vocab], record it, and decide whether `s` is done."""
        position = len(prompt_ids) + len(s.token_ids)
        token = sample(logits, params, s.seed, position, s.token_ids, prompt_ids, self.eos_token_ids)
        s.token_ids.append(token)
        if s.logprobs is not None:
            top = top_logprobs(logits, token, params.logprobs)
            for tid, lp in top.items():
                lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
            s.logprobs.append(top)
            s.cumulative_logprob += top[token].logprob
        # Stop strings are sought only where the new token could have completed one, as vLLM does: text that
        # came before min_tokens was reached cannot stop the request later.
        search_from = max(0, len(s.text) - max((len(x) for x in params.stop), default=0) + 1)
        s.text = self.tokenizer.decode(s.token_ids, skip_special_tokens=params.skip_special_tokens)
        if token in self.eos_token_ids and not params.ignore_eos:
            s.finish_reason = "stop"
        elif token in params.stop_token_ids:
            s.finish_reason, s.stop_reason = "stop", token
        elif params.stop and len(s.token_ids) >= params.min_tokens and self._find_stop(s, params, search_from):
            s.finish_reason = "stop"
        elif len(s.token_ids) == params.max_tokens or position + 1 >= self.max_model_len:
            s.finish_reason = "length"

    @staticmethod
    def _find_stop(s: _Sample, params: SamplingParams, start: int) -> bool:
        """End `s` at the earliest stop string in its text from `start` (trimmed there, or after it if asked)."""
        hits = [(at, stop) for stop in params.stop if (at := s.text.find(stop, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        s.text = s.text[: at + len(stop)] if params.include_stop_str_in_output else s.text[:at]
        s.stop_reason = stop
        return True
