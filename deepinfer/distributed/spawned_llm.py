"""`LLM(..., expert_parallel_size=N)` in a process that is no rank: it starts N rank processes on this host.

The ranks are spawned (torch.multiprocessing, spawn), join one process group (gloo on the cpu, NCCL on GPUs; rank r
on GPU r) and each builds its `RankLLM` (deepinfer/distributed/rank_llm.py). This process keeps only the config and
the tokenizer: each call's prompts and parameters go to every rank, and rank 0's gathered outputs come back. A
watchdog follows the ranks while it waits: a rank that dies (killed, or an exception) ends the call with an error
naming it, and the others are stopped; an LLM whose ranks failed refuses later calls.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch.multiprocessing as mp

from deepinfer.config import DeepseekV41Config
from deepinfer.distributed import ranks
from deepinfer.engine import EngineArgs
from deepinfer.engine.spec_decode import SpeculativeConfig
from deepinfer.inputs import PromptType
from deepinfer.llm import LLM, _prompt_list, check_target
from deepinfer.models.weights import ExpertShard
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import load_tokenizer
from kernels.targets import DEFAULT_TARGET

logger = logging.getLogger(__name__)

_POLL_S = 0.2  # how often the watchdog looks at the ranks while it waits
_GRACE_S = 5.0  # how long the others get to report once one rank has failed, so the first cause is named


class RankFailedError(RuntimeError):
    """A rank of an expert-parallel LLM died or raised; the message names it (and what the others said)."""


class SpawnedLLM(LLM):
    """Starts the ranks and serves the user's calls through them (see the module's docstring)."""

    def __init__(self, model: str | os.PathLike | None = None, target: str = DEFAULT_TARGET,
                 tokenizer: str | None = None, constraint: Any = None, speculative_config: dict | None = None,
                 device: str = "cpu", fp8_activations: bool = False, **kwargs: Any) -> None:
        from deepinfer.default_model import default_checkpoint

        self.engine_args = EngineArgs.from_kwargs(kwargs, "LLM()", ["model", "target", "tokenizer", "constraint",
                                                                    "speculative_config", "device", "fp8_activations"])
        SpeculativeConfig.from_dict(speculative_config)  # a bad one is refused here, before any rank starts
        if constraint is not None:
            raise ValueError("constraint: a custom token constraint cannot be sent to the ranks' processes; "
                             "structured outputs (the default) run on every rank")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"with expert_parallel_size > 1, model must be a checkpoint directory or None (each rank "
                            f"loads its own share of it), got {type(model).__name__}")
        check_target(target, device)
        path = os.fspath(default_checkpoint() if model is None else model)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model {path!r}: no such directory (a checkpoint directory holds config.json "
                                    "and model.safetensors)")
        self.model_dir, self.config = path, DeepseekV41Config.from_pretrained(path)
        world_size = self.engine_args.expert_parallel_size
        for count in (self.config.n_routed_experts, self.config.dspark_n_routed_experts * bool(speculative_config)):
            ExpertShard(0, world_size).experts(count)  # raises before any rank starts when they do not split
        self.tokenizer = load_tokenizer(tokenizer or path)
        self._failure: str | None = None
        build = {"model": path, "target": target, "tokenizer": tokenizer, "speculative_config": speculative_config,
                 "device": device, "fp8_activations": fp8_activations, **kwargs}
        self._start(world_size, build)

    def _start(self, world_size: int, build: dict[str, Any]) -> None:
        from deepinfer.distributed.worker import run_rank

        context = mp.get_context("spawn")
        port = ranks.free_port()  # for the group's rendezvous
        self._results = context.Queue()
        self._commands = [context.Queue() for _ in range(world_size)]
        self._ranks = [context.Process(target=run_rank, args=(r, world_size, port, build, self._commands[r],
                                                              self._results), daemon=True, name=f"deepinfer-rank-{r}")
                       for r in range(world_size)]
        for p in self._ranks:
            p.start()
        self.max_model_len = self._collect()  # every rank built its LLM; rank 0 says what its engine holds

    def iter_generate(self, prompts: PromptType | Sequence[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                      use_tqdm: bool = False) -> Iterator[tuple[int, RequestOutput]]:
        """As `LLM.iter_generate`; the outputs come in input order once every rank is done."""
        if self._failure is not None:
            raise RankFailedError(f"this LLM's ranks failed earlier: {self._failure}")
        prompts = list(_prompt_list(prompts))
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        for commands in self._commands:
            commands.put((prompts, params_list))
        try:
            outputs = self._collect()
        except RankFailedError:
            raise
        except BaseException:  # interrupted: the ranks' answers to this call would reach the next one
            self.close()
            self._failure = "a call was interrupted while the ranks ran it"
            raise
        yield from enumerate(outputs)

    def _collect(self) -> Any:
        """Wait for every rank's answer to the last command, watching that each stays alive; rank 0's answer."""
        pending, answer = set(range(len(self._ranks))), None
        while pending:
            try:
                rank, error, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                if any(p.exitcode is not None for p in self._ranks):
                    self._fail({})
                continue
            if error is not None:
                self._fail({rank: error})
            pending.discard(rank)
            answer = value if rank == 0 else answer
        return answer

    def _fail(self, errors: dict[int, str]) -> None:
        """Gather what the ranks say for a moment, stop them all, and raise naming the rank(s) at fault."""
        deadline, settled = time.time() + _GRACE_S, False
        while not settled:  # until every rank has exited (or the grace is over) and nothing is left to read
            try:
                rank, error, _ = self._results.get(timeout=_POLL_S)
                if error is not None:
                    errors.setdefault(rank, error)
            except queue.Empty:
                settled = time.time() > deadline or all(p.exitcode is not None for p in self._ranks)
        self.close()
        parts = [_death(r, p.exitcode) for r, p in enumerate(self._ranks) if r not in errors and p.exitcode]
        parts += [f"rank {r} failed: {errors[r]}" for r in sorted(errors)]
        self._failure = "; ".join(parts) or "a rank stopped without a word"
        raise RankFailedError(self._failure)

    def close(self) -> None:
        """Stop the ranks (each leaves the group and exits); the LLM cannot generate after it."""
        for commands, p in zip(self._commands, self._ranks, strict=True):
            if p.is_alive():
                commands.put(None)
        for p in self._ranks:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        for q in [*self._commands, self._results]:
            q.close()
        self._failure = self._failure or "closed"

    def __del__(self) -> None:
        if getattr(self, "_failure", "closed") is None:
            self.close()

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("beam_search runs on one device: LLM(..., expert_parallel_size=1)")


def _death(rank: int, exitcode: int) -> str:
    if exitcode < 0:
        return f"rank {rank} died (killed by {signal.Signals(-exitcode).name})"
    return f"rank {rank} exited with code {exitcode}"


def format_error(e: BaseException) -> str:
    """A rank's exception in one line (its traceback goes to the rank's stderr)."""
    traceback.print_exception(e)
    return f"{type(e).__name__}: {e}"


__all__ = ["RankFailedError", "SpawnedLLM", "format_error"]
