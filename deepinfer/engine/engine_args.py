"""The engine's arguments: one frozen dataclass, vLLM's names where vLLM has one.

`EngineArgs.from_kwargs` is how `LLM(**kwargs)` reads them: an unknown name is a `TypeError` that names the closest
valid one; the few vLLM options that have no meaning here (`VLLM_OPTIONS_WITHOUT_EFFECT`) are accepted with a log
line, so a ported script runs; several devices are asked for through `expert_parallel_size`, not tensor parallelism.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The cpu target's cache budget when none is given: the embedded model's caches take about 70 KiB per running
# sequence plus 80 bytes per token, so this holds 64 sequences of 100k tokens.
DEFAULT_CPU_CACHE_BYTES = 512 << 20

# vLLM engine options a ported script may pass that change nothing here, and why.
VLLM_OPTIONS_WITHOUT_EFFECT = {
    "dtype": "the target fixes the arithmetic (fp32 on the cpu; bf16 operands with fp32 sums on GPU targets)",
    "quantization": "the checkpoint's own quantization_config is read",
    "kv_cache_dtype": "every cache has the model's own format (fp8 windows, fp4 compressed KV)",
    "trust_remote_code": "no code is run from a checkpoint",
    "tokenizer_mode": "the checkpoint's tokenizer.json is used through the `tokenizers` library",
    "revision": "checkpoints are local directories",
    "download_dir": "checkpoints are local directories",
    "swap_space": "preempted sequences are recomputed, never swapped to host memory",
    "enable_chunked_prefill": "prompts are always prefilled in chunks under max_num_batched_tokens",
    "disable_log_stats": "no periodic statistics are logged",
}


@dataclass(frozen=True)
class EngineArgs:
    """How the engine batches, caches and samples.

    - `max_num_seqs`: sequences (samples) running at once; each holds a cache slot (its windows).
    - `max_num_batched_tokens`: tokens in one forward; prompts longer than what is left are prefilled in chunks.
    - `max_model_len`: prompt plus completion, at most; None: the model's `max_position_embeddings`, or the longest
      sequence the cache budget holds beside the `max_num_seqs` slots when that is less.
    - `kv_cache_memory_bytes`: the budget for every cache (slots first, then blocks); None: on a GPU
      `gpu_memory_utilization` of the device memory left free after the weights, on the cpu 512 MiB.
    - `gpu_memory_utilization`: that share, in (0, 1] (vLLM's name and default).
    - `block_size`: token positions per cache block; None: the smallest multiple of the compress ratios >= 16.
    - `async_scheduling`: schedule step n + 1 while step n runs; the tokens are the same either way when
      `batch_invariant` is on (off, a wasted step for a request that just stopped can change its neighbours'
      rounding). On the cpu target it gains nothing measurable (bench/RESULTS.md); it is for the GPU targets.
    - `batch_invariant`: a request's logits are bitwise the same alone or in any batch, however its prompt is chunked.
      On by default: on the cpu target it costs 2 to 5% of throughput at batch 16 and about 20% at batch 1.
    - `overlap_structured_outputs`: fill the structured-output masks on a CPU thread while the forward runs, rather
      than after it (the masks are the same either way).
    - `seed`: draws the seed of every request that brings none (reported in its output).
    - `enable_prefix_caching`: full blocks are shared by the sequences whose tokens reach them and kept, once freed,
      until needed, so a prompt that starts as an earlier one did (a request's `n` samples, a shared system prompt,
      a preempted sequence's recompute) resumes after them from a snapshot of its windows (docs/prefix_caching.md).
      Outputs are bitwise those without it when `batch_invariant` is on; `RequestOutput.num_cached_tokens` reports
      the hit. On by default: on the cpu target 64 requests sharing a 2,000-token prefix run many times faster
      with it, and prompts that share nothing pay a prefill chunk cut every `snapshot_interval` tokens
      (bench/RESULTS.md).
    - `expert_parallel_size`: ranks (one device each) the routed experts are split over; attention is data-parallel,
      each rank running its own share of the requests (deepinfer/distributed/). 1: one device, no ranks.
    - `data_parallel_size`: ranks running requests; None: `expert_parallel_size`, the only value allowed.
    - `engram_storage`: "host" keeps the Engram tables in host memory, each forward's rows fetched while the first
      layers run; "device" with the other weights; None: host when they take over half of a GPU's free memory.
    - `swa_replay_tokens`: bounded replay (deepinfer/replay.py): every prefill (each chunk, a resume after a prefix
      hit, the recompute after a preemption) runs the decoder layers from the prompt's last `swa_replay_tokens`
      tokens on, their windows cut there (a recompute over its outputs too, so preemption leaves outputs as they
      were); a defined approximation of the exact forward, on the cpu target. None (the default): exact. At least
      `sliding_window + num_speculative_tokens + 1` (DeepSeek uses 140 for V4.1). With prefix caching, a hit resumes
      only at a snapshot whose decoder windows are the sequence's own (at or before its replay position, or taken
      with the same one), so outputs stay bitwise those without the cache (docs/prefix_caching.md).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int | None = None
    async_scheduling: bool = True
    batch_invariant: bool = True
    overlap_structured_outputs: bool = True
    seed: int = 0
    enable_prefix_caching: bool = True
    expert_parallel_size: int = 1
    data_parallel_size: int | None = None
    engram_storage: str | None = None
    swa_replay_tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and (not _is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2 (a prompt token and a completion token) or None, "
                             f"got {self.max_model_len!r}")
        if self.kv_cache_memory_bytes is not None and (not _is_int(self.kv_cache_memory_bytes)
                                                       or self.kv_cache_memory_bytes < 1):
            raise ValueError(f"kv_cache_memory_bytes must be an integer > 0 or None, "
                             f"got {self.kv_cache_memory_bytes!r}")
        u = self.gpu_memory_utilization
        if not isinstance(u, (int, float)) or isinstance(u, bool) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {u!r}")
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 1):
            raise ValueError(f"block_size must be an integer >= 1 or None, got {self.block_size!r}")
        for name in ("async_scheduling", "batch_invariant", "overlap_structured_outputs", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                # ValueError as for every other bad field (and as SamplingParams), so callers catch one type
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")  # noqa: TRY004
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not _is_int(self.expert_parallel_size) or self.expert_parallel_size < 1:
            raise ValueError(f"expert_parallel_size must be an integer >= 1, got {self.expert_parallel_size!r}")
        if self.data_parallel_size not in (None, self.expert_parallel_size):
            raise ValueError(f"data_parallel_size={self.data_parallel_size!r} must equal expert_parallel_size="
                             f"{self.expert_parallel_size}: every rank holds a share of the experts and runs a share "
                             "of the requests")
        if self.engram_storage not in (None, "host", "device"):
            raise ValueError(f"engram_storage must be 'host', 'device' or None (chosen by size), "
                             f"got {self.engram_storage!r}")
        if self.swa_replay_tokens is not None and (not _is_int(self.swa_replay_tokens) or self.swa_replay_tokens < 1):
            raise ValueError(f"swa_replay_tokens must be an integer >= 1 or None (exact prefill), "
                             f"got {self.swa_replay_tokens!r}")

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any], caller: str = "LLM()", other_names: Iterable[str] = ()) -> EngineArgs:
        """EngineArgs from `caller`'s keyword arguments.

        A name that is neither a field, one of `other_names` (the caller's own parameters, for the suggestion) nor
        in `VLLM_OPTIONS_WITHOUT_EFFECT` raises TypeError naming the closest valid one; those without effect are
        logged and dropped; `tensor_parallel_size` and `pipeline_parallel_size` above 1 raise ValueError.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        for name, value in kwargs.items():
            if name in names or name in VLLM_OPTIONS_WITHOUT_EFFECT:
                continue
            if name in ("tensor_parallel_size", "pipeline_parallel_size"):
                if value not in (None, 1):
                    raise ValueError(f"{name}={value!r}: DeepInfer does not split layers across devices; "
                                     "expert_parallel_size is the way to use several devices (experts split across "
                                     "them, attention data-parallel)")
                continue
            valid = sorted(names | set(other_names) | set(VLLM_OPTIONS_WITHOUT_EFFECT))
            close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else f"; valid names: {', '.join(valid)}"
            raise TypeError(f"{caller} got an unexpected keyword argument {name!r}{hint}")
        for name in sorted(set(kwargs) & set(VLLM_OPTIONS_WITHOUT_EFFECT)):
            logger.info("%s=%r has no effect here: %s", name, kwargs[name], VLLM_OPTIONS_WITHOUT_EFFECT[name])
        return cls(**{k: v for k, v in kwargs.items() if k in names})

    def cache_bytes(self, free_device_bytes: int | None = None) -> int:
        """The cache budget in bytes: `kv_cache_memory_bytes` when given, else `gpu_memory_utilization` of
        `free_device_bytes` (the memory a GPU has left after the weights), else 512 MiB (the cpu)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if free_device_bytes is not None:
            return int(self.gpu_memory_utilization * free_device_bytes)
        return DEFAULT_CPU_CACHE_BYTES


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
