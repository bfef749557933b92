"""The engine's arguments: one frozen dataclass, vLLM's names where vLLM has one."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# The cpu target's cache budget when none is given: the embedded model's caches take about 70 KiB per running
# sequence plus 80 bytes per token, so this holds 64 sequences of 100k tokens.
DEFAULT_CPU_CACHE_BYTES = 512 << 20


@dataclass(frozen=True)
class EngineArgs:
    """How the engine batches, caches and samples.

    - `max_num_seqs`: sequences (samples) running at once; each holds a cache slot (its windows).
    - `max_num_batched_tokens`: tokens in one forward; prompts longer than what is left are prefilled in chunks.
    - `max_model_len`: prompt plus completion, at most; None: the model's `max_position_embeddings`.
    - `kv_cache_memory_bytes`: the budget for every cache (slots first, then blocks); None: 512 MiB on the cpu.
    - `block_size`: token positions per cache block; None: the smallest multiple of the compress ratios >= 16.
    - `async_scheduling`: schedule step n + 1 while step n runs; the tokens are the same either way when
      `batch_invariant` is on (off, a wasted step for a request that just stopped can change its neighbours'
      rounding). On the cpu target it gains nothing measurable (bench/RESULTS.md); it is for the GPU targets.
    - `batch_invariant`: a request's logits are bitwise the same alone or in any batch, however its prompt is chunked.
      On by default: on the cpu target it costs 2 to 5% of throughput at batch 16 and about 20% at batch 1.
    - `overlap_structured_outputs`: fill the structured-output masks on a CPU thread while the forward runs, rather
      than after it (the masks are the same either way).
    - `seed`: draws the seed of every request that brings none (reported in its output).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    async_scheduling: bool = True
    batch_invariant: bool = True
    overlap_structured_outputs: bool = True
    seed: int = 0

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
        if self.block_size is not None and (not _is_int(self.block_size) or self.block_size < 1):
            raise ValueError(f"block_size must be an integer >= 1 or None, got {self.block_size!r}")
        for name in ("async_scheduling", "batch_invariant", "overlap_structured_outputs"):
            if not isinstance(getattr(self, name), bool):
                # ValueError as for every other bad field (and as SamplingParams), so callers catch one type
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")  # noqa: TRY004
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keyword arguments; those it lacks (vLLM's GPU options, say) are logged and ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            logger.warning("ignoring engine arguments that DeepInfer does not have: %s", ", ".join(unknown))
        return cls(**{k: v for k, v in kwargs.items() if k in names})

    @property
    def cache_bytes(self) -> int:
        """The cache budget in bytes."""
        return DEFAULT_CPU_CACHE_BYTES if self.kv_cache_memory_bytes is None else self.kv_cache_memory_bytes


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
