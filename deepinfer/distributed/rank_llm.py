"""One rank's LLM (expert parallelism with data-parallel attention): its share of the experts, of the requests.

Every rank is given every request of a call, in the same order. Each draws every request's seed in that order (as
one engine would: `LLMEngine.draw_seed`), queues requests i with i % world_size == rank to its own engine (its own
scheduler, caches and model runner), runs them over its `LockstepRuntime` (graphs/lockstep.py: the routed experts
split over the ranks; the cpu target's interpreter, or a GPU target's plan with one NCCL rank a GPU), serves the
others' forwards until every rank is done, and the outputs are gathered on every rank with their single-device
request ids, in input order. So `generate` returns on each rank what one device's `LLM.generate` returns.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.distributed import ranks
from deepinfer.inputs import PromptType
from deepinfer.llm import LLM, _prompt_list
from deepinfer.models.weights import ExpertShard
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from graphs.interpreter import Interpreter
from graphs.lockstep import LockstepRuntime
from graphs.plan_runtime import PlanRuntime
from kernels.targets import DEFAULT_TARGET, INTERPRETER, get_target


class RankLLM(LLM):
    """`LLM` as rank `ranks.current()` (joined from torchrun's environment when no rank is set yet)."""

    def __init__(self, model: Any = None, target: str = DEFAULT_TARGET, *args: Any, device: str = "cpu",
                 **kwargs: Any) -> None:
        self._group_device = ranks.group_device(target, device)
        info = ranks.current()
        if info is None:
            info = ranks.join(ranks.from_torchrun(), self._group_device)
        size = kwargs.get("expert_parallel_size", 1)
        if size != info.world_size:
            raise ValueError(f"expert_parallel_size={size} but this process is rank {info.rank} of "
                             f"{info.world_size}: they must be equal")
        self.rank_info = info
        if info.rank != 0:  # the model's line once, from rank 0
            logging.getLogger("deepinfer.llm").setLevel(logging.WARNING)
        self._shard = ExpertShard(info.rank, info.world_size)
        self._num_requests = 0
        interpreted = get_target(target).runtime == INTERPRETER
        super().__init__(model, target, *args, device=info.device(device) if interpreted else device, **kwargs)
        if not isinstance(self.compiled.runtime, (Interpreter, PlanRuntime)):
            raise TypeError(f"expected the interpreter or the plan runtime, got {type(self.compiled.runtime).__name__}")
        self.compiled.runtime = LockstepRuntime(self.compiled.runtime)

    def _compile(self, network: Any, target: str, options: dict[str, Any]) -> Any:
        """One device's compile, of this rank's share. A GPU target's ranks share its cubins (the build cache,
        graphs/aot.py): rank 0 builds them, with the expert-parallel MoE launches, then the others find them built."""
        if get_target(target).runtime == INTERPRETER:
            return super()._compile(network, target, options)
        options = dict(options, expert_parallel=True)
        compiled, error = None, None
        for turn in (0, 1):
            if (self.rank_info.rank == 0) == (turn == 0):
                try:
                    compiled = super()._compile(network, target, options)
                except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
                    error = e
            failed = torch.tensor([error is not None], dtype=torch.int32, device=self._group_device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if error is not None:
                raise error
            if failed.item():
                raise RuntimeError(f"rank {self.rank_info.rank}: another rank failed to compile the model")
        return compiled

    def _load(self, model: Any, tokenizer: str | None) -> Any:
        """This rank's share of the model: every weight but the other ranks' routed experts, which it never reads
        (rank 0 under a progress bar)."""
        from deepinfer.default_model import default_checkpoint
        from deepinfer.models import DeepseekV41Flash
        from deepinfer.tokenizer import load_tokenizer

        if isinstance(model, DeepseekV41Flash):
            cfg = model.config
            held = {name: t for name, t in model.weights.items() if self._shard.holds(name, cfg)}
            model = DeepseekV41Flash(cfg, held, model.model_dir, model.tokenizer, self._shard)
            return super()._load(model, tokenizer)
        path = default_checkpoint() if model is None else model
        if not isinstance(path, (str, os.PathLike)) or not os.path.isdir(path):
            return super()._load(model, tokenizer)  # the same errors as one device's
        self.tokenizer = load_tokenizer(tokenizer or path)
        network = DeepseekV41Flash.from_pretrained(path, self._shard, progress=self._shard.rank == 0)
        network.tokenizer = self.tokenizer
        return network

    def iter_generate(self, prompts: PromptType | Sequence[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      use_tqdm: bool = False) -> Iterator[tuple[int, RequestOutput]]:
        """As `LLM.iter_generate`, every rank given the same call; outputs come in input order once all are done."""
        prompts = _prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        seeds = [self.engine.draw_seed(p) for p in params_list]  # every request's, in order, on every rank
        first, self._num_requests = self._num_requests, self._num_requests + len(prompts)
        mine = self._run_share(prompts, params_list, seeds, first)
        parts: list[dict[int, RequestOutput] | None] = [None] * self.rank_info.world_size
        dist.all_gather_object(parts, mine)
        outputs = {i: out for part in parts for i, out in (part or {}).items()}
        for i in range(len(prompts)):
            yield i, outputs[i]

    def _run_share(self, prompts: Sequence[PromptType], params_list: list[SamplingParams], seeds: list[int],
                   first: int) -> dict[int, RequestOutput]:
        """Run this rank's requests; their outputs by input index, with the request ids one device gives them."""
        info, arrival, index, outputs = self.rank_info, time.time(), {}, {}
        try:
            for i in range(info.rank, len(prompts), info.world_size):
                index[self.engine.add_request(prompts[i], params_list[i], arrival, seeds[i])] = i
            for out in self.engine.run():
                i = index[out.request_id]
                self._add_prompt_logprobs(out, params_list[i])
                out.request_id = str(first + i)
                outputs[i] = out
            self.compiled.runtime.finish()
        except BaseException:
            self.engine.abort_all()
            raise
        return outputs

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("beam_search runs on one device: LLM(..., expert_parallel_size=1)")


__all__ = ["RankLLM"]
