"""`LLM`: the offline entry point, as in vLLM: load and compile a model once, then `generate` (or `chat`) completions.

`generate` hands every prompt to the engine (deepinfer/engine/), which batches them continuously, and returns the
outputs in input order; `iter_generate` yields each output as its request finishes, for callers that save as they go.
A bad request of any kind (a malformed prompt, parameters that are not a SamplingParams) fails alone with its
message; nothing queued for one call is left for the next. `chat` renders conversations with the checkpoint's chat
template (deepinfer/chat.py), `beam_search` runs vLLM's beam search over the engine (deepinfer/beam_search.py).
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Self

import torch
from tqdm import tqdm

from deepinfer.compile import compile as compile_model
from deepinfer.cpu_threads import choose_cpu_threads, cpu_threads
from deepinfer.engine import EngineArgs, LLMEngine, TokenConstraint
from deepinfer.engine.request import RequestError
from deepinfer.engine.spec_decode import DSparkSpeculator, SpeculativeConfig
from deepinfer.inputs import PromptType
from deepinfer.model_card import describe_model
from deepinfer.outputs import RequestOutput
from deepinfer.replay import check_replay_tokens
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured_outputs.constraint import StructuredOutputConstraint
from deepinfer.tokenizer import load_tokenizer
from kernels.targets import DEFAULT_TARGET, INTERPRETER, get_built_target, get_target

if TYPE_CHECKING:
    from deepinfer.beam_search import BeamSearchOutput, BeamSearchParams
    from deepinfer.models import DeepseekV41Flash

logger = logging.getLogger(__name__)

__all__ = ["LLM", "DeviceUnavailableError", "PromptType", "RequestError"]

# generation_config.json keys a checkpoint may set, and the SamplingParams field each is
_GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


class DeviceUnavailableError(RuntimeError):
    """The target (or device) needs a GPU this machine does not have."""


def check_target(target: str, device: str = "cpu") -> None:
    """Raise at once, before any loading or compiling, when `target` cannot run here (the message says why)."""
    record = get_built_target(target)
    if record.runtime == INTERPRETER:
        if device != "cpu" and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(f"device={device!r}: torch sees no CUDA GPU on this machine")
        return
    family = record.description.split(":")[0]
    major = record.compute_capability[0]
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            f"target {target!r} runs on an NVIDIA {family} GPU, and torch sees no CUDA GPU on this machine; "
            f"target={DEFAULT_TARGET!r} runs anywhere (deepinfer.compile(model, {target!r}) builds the artifact "
            f"without a GPU)")
    found = torch.cuda.get_device_capability()
    if found[0] != major:
        raise DeviceUnavailableError(f"target {target!r} runs on an NVIDIA {family} GPU (compute capability {major}.x)"
                                     f"; this one, {torch.cuda.get_device_name()}, is {found[0]}.{found[1]}")


class LLM:
    """Generate completions with DeepSeek-V4.1-Flash.

    `model` is a checkpoint directory (config.json and safetensors), a `DeepseekV41Flash` (such as the random-weight
    `deepinfer.default_model.default_model()`), or None for the embedded default: a tiny V4.1-Flash trained on the
    Python standard library (`deepinfer.default_model.default_checkpoint()` is its directory). `target` is the
    compile target (kernels/targets.py: the default, cpu, runs anywhere; a GPU target without its GPU is refused at
    once). `tokenizer` is a
    directory holding tokenizer.json (default: the model's, else the V4 tokenizer).
    Every other keyword is an engine argument (`EngineArgs`: `max_model_len`, `max_num_seqs`,
    `max_num_batched_tokens`, `kv_cache_memory_bytes`, `gpu_memory_utilization`, `block_size`, `async_scheduling`,
    `batch_invariant`, `seed`, `enable_prefix_caching`, `swa_replay_tokens`, `expert_parallel_size`,
    `engram_storage`); an unknown one is a TypeError naming the closest valid name, and the few vLLM options without
    effect here are accepted with a log line (`VLLM_OPTIONS_WITHOUT_EFFECT`). `constraint` replaces
    the token-constraint hook (`deepinfer.engine.TokenConstraint`); by default it is structured outputs, built on
    the first request that asks for them (`SamplingParams(structured_outputs=...)`). `speculative_config` turns on
    DSpark drafting, e.g. `{"method": "dspark", "num_speculative_tokens": 5}` (`deepinfer.engine.SpeculativeConfig`
    lists the keys); off by default. Outputs are the same with and without it (greedy or seeded, in batch-invariant
    mode). `device` runs the cpu target's torch code elsewhere ("cuda": eagerly on a GPU). `fp8_activations` (GPU
    targets) rounds the inputs of the fp8-weight linears to e4m3 for the fp8 tensor cores (`deepinfer.compile`):
    faster prefill, not the reference's exact products. On the cpu target the thread count is chosen from the
    cores left idle (deepinfer/cpu_threads.py), for compiling and generating; the model, its size and the threads
    are logged in one line. `expert_parallel_size=N` (N > 1) runs N ranks, the routed experts split over them and
    the requests too, with the outputs of one device (deepinfer/distributed/).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        """`expert_parallel_size` above 1 makes an LLM of several ranks (deepinfer/distributed/): the one that starts
        them, or, in a process that is a rank (spawned, or started by torchrun), that rank's."""
        kind = cls
        if cls is LLM and kwargs.get("expert_parallel_size", 1) != 1:
            from deepinfer.distributed import parallel_llm_class

            kind = parallel_llm_class()
        return super().__new__(kind)

    def __init__(self, model: str | os.PathLike | DeepseekV41Flash | None = None, target: str = DEFAULT_TARGET,
                 tokenizer: str | None = None, constraint: TokenConstraint | None = None,
                 speculative_config: dict | None = None, device: str = "cpu", fp8_activations: bool = False,
                 **kwargs: Any) -> None:
        own = [name for name in inspect.signature(LLM.__init__).parameters if name not in ("self", "kwargs")]
        self.engine_args = EngineArgs.from_kwargs(kwargs, "LLM()", own)
        speculative = SpeculativeConfig.from_dict(speculative_config)
        check_target(target, device)
        network = self._load(model, tokenizer)
        self.config, self.model_dir = network.config, network.model_dir
        replay = self.engine_args.swa_replay_tokens
        check_replay_tokens(self.config, replay, speculative.num_speculative_tokens if speculative else 0)
        options = {"drafting": True} if speculative else {}
        if replay is not None:
            options["replay"] = True
        if fp8_activations:
            options["fp8_activations"] = True
        if self.engine_args.engram_storage is not None:
            options["engram_storage"] = self.engine_args.engram_storage
        interpreted = get_target(target).runtime == INTERPRETER
        if device != "cpu":
            if not interpreted:
                raise ValueError(f"device={device!r} runs the cpu target's torch code on that device; target "
                                 f"{target!r} chooses its own")
            options["device"] = device
        self._threads, threads = choose_cpu_threads() if interpreted and device == "cpu" else (None, "")
        logger.info("model: %s; target %s%s", describe_model(network, embedded=model is None), target,
                    f", {threads}" if threads else "")
        self.compiled = self._compile(network, target, options)
        eos = self.config.eos_token_ids or (self.tokenizer.eos_token_id,)
        self.eos_token_ids = tuple(t for t in eos if t is not None and 0 <= t < self.config.vocab_size)
        if constraint is None:
            constraint = StructuredOutputConstraint(self._structured_output_manager)
        speculator = None if speculative is None else DSparkSpeculator(self.compiled, speculative, self.eos_token_ids,
                                                                      self.engine_args.batch_invariant)
        self.engine = LLMEngine(self.compiled, self.tokenizer, self.engine_args, self.eos_token_ids, constraint,
                                speculator)
        self.engine.threads = self._threads
        self.max_model_len = self.engine.max_model_len
        # The model's many long-lived objects leave the collector's view, as vLLM does, so that no full collection
        # walks them in the middle of a step. Garbage goes first, so nothing dead is frozen.
        gc.collect()
        gc.freeze()

    def _load(self, model: str | os.PathLike | DeepseekV41Flash | None, tokenizer: str | None) -> DeepseekV41Flash:
        """The model, with `self.tokenizer` set to the tokenizer prompts go through (Engram's token map is its)."""
        from deepinfer.models import DeepseekV41Flash

        if model is None:
            from deepinfer.default_model import trained_model

            model = trained_model()
        if isinstance(model, DeepseekV41Flash):  # a model object: its own tokenizer, unless one is given
            if tokenizer is not None or model.tokenizer is None:
                model.tokenizer = load_tokenizer(tokenizer or model.model_dir)
            self.tokenizer = model.tokenizer
            return model
        if not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint directory, a DeepseekV41Flash or None, "
                            f"got {type(model).__name__}")
        if not os.path.isdir(model):
            raise FileNotFoundError(f"model {os.fspath(model)!r}: no such directory (a checkpoint directory holds "
                                    "config.json and model.safetensors)")
        self.tokenizer = load_tokenizer(tokenizer or model)
        network = DeepseekV41Flash.from_pretrained(model)
        network.tokenizer = self.tokenizer
        return network

    def _compile(self, network: DeepseekV41Flash, target: str, options: dict[str, Any]) -> Any:
        """`deepinfer.compile` of the loaded model for `target` with the options the engine arguments ask for."""
        with cpu_threads(self._threads):
            return compile_model(network, target=target, **options)

    def _structured_output_manager(self):
        from deepinfer.structured_outputs.manager import StructuredOutputManager  # xgrammar: only when asked for

        return StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.eos_token_ids)

    def get_tokenizer(self):
        """The tokenizer prompts and completions go through, as a `transformers.PreTrainedTokenizerFast` over the
        same tokenizer.json (`tok(text)`, `decode`, `batch_decode`, `apply_chat_template`, ...)."""
        return self.tokenizer.hf()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the checkpoint's generation_config.json (temperature, top_p, top_k,
        min_p, repetition_penalty, max_new_tokens), as vLLM reads them; SamplingParams() without one."""
        path = os.path.join(self.model_dir, "generation_config.json") if self.model_dir else None
        if path is None or not os.path.isfile(path):
            return SamplingParams()
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"{path} is not a JSON object")  # noqa: TRY004 - a bad file, as below
        fields = {field: config[key] for key, field in _GENERATION_DEFAULTS.items() if config.get(key) is not None}
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; results in input order.

        A prompt is a string, `TextPrompt` `{"prompt": str}` or `TokensPrompt` `{"prompt_token_ids": list[int]}`.
        `sampling_params` is one SamplingParams for all prompts or one per prompt (default:
        `get_default_sampling_params()`). A request that cannot run comes back with `error` set and finish_reason
        "error"; the others are not affected.
        """
        results: dict[int, RequestOutput] = dict(self.iter_generate(prompts, sampling_params, use_tqdm))
        return [results[i] for i in range(len(results))]

    def iter_generate(self, prompts: PromptType | Sequence[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      use_tqdm: bool = False) -> Iterator[tuple[int, RequestOutput]]:
        """As `generate`, but yields (input index, output) as each request finishes, in the order they finish."""
        prompts = _prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        arrival = time.time()
        finished, index = False, {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                index[self.engine.add_request(prompt, params, arrival)] = i
            with tqdm(total=len(prompts), desc="Processed prompts", unit="req", disable=not use_tqdm) as bar:
                for out in self.engine.run():
                    bar.update(1)
                    i = index[out.request_id]
                    self._add_prompt_logprobs(out, params_list[i])
                    yield i, out
            finished = True
        finally:
            if not finished:  # stopped early (or failed): drop what is left rather than run it with the next call
                self.engine.abort_all()

    def _add_prompt_logprobs(self, out: RequestOutput, params: Any) -> None:
        """Fill `out.prompt_logprobs` when its request asked for them (deepinfer/prompt_logprobs.py)."""
        if out.error is None and isinstance(params, SamplingParams) and params.prompt_logprobs is not None:
            from deepinfer.prompt_logprobs import prompt_logprobs

            out.prompt_logprobs = prompt_logprobs(self.compiled, out.prompt_token_ids, params.prompt_logprobs,
                                                  self.tokenizer, self.engine_args.max_num_batched_tokens,
                                                  self.engine_args.batch_invariant)

    def _params_per_prompt(self, sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                           num_prompts: int) -> list[SamplingParams]:
        """One SamplingParams per prompt; an entry of the wrong type fails its own request (LLMEngine.add_request)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * num_prompts
        if not isinstance(sampling_params, Sequence) or isinstance(sampling_params, str):
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                            f"got {type(sampling_params).__name__}")
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts: pass one, "
                             "or one per prompt")
        return list(sampling_params)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Complete one conversation (a list of `{"role", "content"}` messages) or a list of them, as vLLM's
        `LLM.chat`: each is rendered by `chat_template` (default: the checkpoint's, else DeepSeek's format;
        deepinfer/chat.py) with the assistant's turn opened when `add_generation_prompt`, then generated. A
        malformed conversation fails its own request; each output's `prompt` is the rendered text."""
        from deepinfer.chat import check_conversation, is_conversation, render

        conversations = [messages] if is_conversation(messages) else list(messages)
        hf = self.get_tokenizer()
        prompts: list[Any] = []
        for conversation in conversations:
            try:
                text = render(hf, check_conversation(conversation), chat_template, add_generation_prompt,
                              chat_template_kwargs)
                prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text)})
            except RequestError as e:
                prompts.append(e)  # fails alone, with this message
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search over each prompt (deepinfer/beam_search.py): the `beam_width` best sequences."""
        from deepinfer.beam_search import beam_search

        return beam_search(self, [prompts] if isinstance(prompts, (str, dict)) else list(prompts), params, use_tqdm)


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> Sequence[PromptType]:
    """One prompt or a sequence of them, as a sequence."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    return prompts
