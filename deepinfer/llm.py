"""`LLM`: the offline entry point, as in vLLM: load and compile a model once, then `generate` completions.

`generate` hands every prompt to the engine (deepinfer/engine/), which batches them continuously, and returns the
outputs in input order; `iter_generate` yields each output as its request finishes, for callers that save as they go.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from deepinfer.compile import compile as compile_model
from deepinfer.engine import EngineArgs, LLMEngine, TokenConstraint
from deepinfer.engine.request import PromptType, RequestError
from deepinfer.engine.spec_decode import DSparkSpeculator, SpeculativeConfig
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured_outputs.constraint import StructuredOutputConstraint
from deepinfer.tokenizer import load_tokenizer
from kernels.targets import DEFAULT_TARGET, INTERPRETER, get_target

if TYPE_CHECKING:
    from deepinfer.models import DeepseekV41Flash

logger = logging.getLogger(__name__)

__all__ = ["LLM", "PromptType", "RequestError"]


class LLM:
    """Generate completions with DeepSeek-V4.1-Flash.

    `model` is a checkpoint directory (config.json and safetensors), a `DeepseekV41Flash` (such as the random-weight
    `deepinfer.default_model.default_model()`), or None for the embedded default: a tiny V4.1-Flash trained on the
    Python standard library (`deepinfer.default_model.trained_model()`). `target` is the compile target
    (kernels/targets.py; the default, cpu, runs anywhere). `tokenizer` is a directory holding tokenizer.json
    (default: the model's, else the V4 tokenizer). Every other keyword is an engine argument (`EngineArgs`:
    `max_model_len`, `max_num_seqs`, `max_num_batched_tokens`, `kv_cache_memory_bytes`, `block_size`,
    `async_scheduling`, `batch_invariant`, `seed`);
    vLLM arguments DeepInfer does not have are ignored with a warning. `constraint` replaces the token-constraint
    hook (`deepinfer.engine.TokenConstraint`); by default it is structured outputs, built on the first request that
    asks for them (`SamplingParams(structured_outputs=...)`). `speculative_config` turns on DSpark drafting, e.g.
    `{"method": "dspark", "num_speculative_tokens": 5}` (`deepinfer.engine.SpeculativeConfig` lists the keys);
    off by default. Outputs are the same with and without it (greedy or seeded, in batch-invariant mode).
    `device` runs the cpu target's torch code elsewhere ("cuda": eagerly on a GPU). `fp8_activations` (GPU targets)
    rounds the inputs of the fp8-weight linears to e4m3 for the fp8 tensor cores (`deepinfer.compile`): faster
    prefill, not the reference's exact products.
    """

    def __init__(self, model: str | DeepseekV41Flash | None = None, target: str = DEFAULT_TARGET,
                 tokenizer: str | None = None,
                 constraint: TokenConstraint | None = None, speculative_config: dict | None = None,
                 device: str = "cpu", fp8_activations: bool = False, **kwargs: Any) -> None:
        from deepinfer.models import DeepseekV41Flash

        self.engine_args = EngineArgs.from_kwargs(**kwargs)
        speculative = SpeculativeConfig.from_dict(speculative_config)
        if model is None:
            from deepinfer.default_model import trained_model

            model = trained_model()
        if isinstance(model, DeepseekV41Flash):  # a model object: its own tokenizer, unless one is given
            network = model
            if tokenizer is not None or network.tokenizer is None:
                network.tokenizer = load_tokenizer(tokenizer or network.model_dir)
            self.tokenizer = network.tokenizer
        else:
            self.tokenizer = load_tokenizer(tokenizer or model)
            network = DeepseekV41Flash.from_pretrained(model)
            network.tokenizer = self.tokenizer  # Engram's token map must come from the tokenizer prompts go through
        self.config = network.config
        options = {"drafting": True} if speculative else {}
        if fp8_activations:
            options["fp8_activations"] = True
        if device != "cpu":
            if get_target(target).runtime != INTERPRETER:
                raise ValueError(f"device={device!r} runs the cpu target's torch code on that device; target "
                                 f"{target!r} chooses its own")
            options["device"] = device
        self.compiled = compile_model(network, target=target, **options)
        eos = self.config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(t for t in eos if t is not None and 0 <= t < self.config.vocab_size)
        if constraint is None:
            constraint = StructuredOutputConstraint(self._structured_output_manager)
        speculator = None if speculative is None else DSparkSpeculator(self.compiled, speculative, self.eos_token_ids,
                                                                      self.engine_args.batch_invariant)
        self.engine = LLMEngine(self.compiled, self.tokenizer, self.engine_args, self.eos_token_ids, constraint,
                                speculator)
        self.max_model_len = self.engine.max_model_len
        # The model's many long-lived objects leave the collector's view, as vLLM does: a full collection over them
        # mid-step cost up to 10 ms a step here. Garbage goes first, so nothing dead is frozen.
        gc.collect()
        gc.freeze()

    def _structured_output_manager(self):
        from deepinfer.structured_outputs.manager import StructuredOutputManager  # xgrammar: only when asked for

        return StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.eos_token_ids)

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
        results: dict[int, RequestOutput] = dict(self.iter_generate(prompts, sampling_params, use_tqdm))
        return [results[i] for i in range(len(results))]

    def iter_generate(self, prompts: PromptType | Sequence[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      use_tqdm: bool = False) -> Iterator[tuple[int, RequestOutput]]:
        """As `generate`, but yields (input index, output) as each request finishes, in the order they finish."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        arrival = time.time()
        pairs = enumerate(zip(prompts, params_list, strict=True))
        index = {self.engine.add_request(prompt, params, arrival): i for i, (prompt, params) in pairs}
        finished = False
        try:
            with tqdm(total=len(prompts), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
                for out in self.engine.run():
                    bar.update(1)
                    yield index[out.request_id], out
            finished = True
        finally:
            if not finished:  # the caller stopped early: drop what is left rather than run it with the next call
                self.engine.abort_all()

    @staticmethod
    def _params_per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                           num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        params_list = list(sampling_params)
        if len(params_list) != num_prompts:
            raise ValueError(f"got {len(params_list)} SamplingParams for {num_prompts} prompts: pass one, "
                             "or one per prompt")
        return params_list
