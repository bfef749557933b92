"""How much memory the caches get, and so how long a sequence may be.

On a GPU the budget is `gpu_memory_utilization` of the memory the device has free once the weights are on it; on the
cpu it is a fixed 512 MiB; `kv_cache_memory_bytes` overrides both. `max_model_len` defaults to the smaller of the
config's `max_position_embeddings` and the longest sequence that budget holds beside the slots of `max_num_seqs`
sequences, and the choice is logged in one line, so a real checkpoint (a million positions) opens with the defaults.
"""

from __future__ import annotations

import logging

import torch

from deepinfer.engine.block_manager import CacheLayout
from deepinfer.engine.engine_args import EngineArgs
from dsl.cache import CacheSpec

logger = logging.getLogger(__name__)


def free_device_bytes(device: str | torch.device) -> int | None:
    """Bytes free now on `device` if it is a CUDA device (the weights already placed), else None."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free


def plan_caches(spec: CacheSpec, args: EngineArgs, max_position_embeddings: int,
                device: str | torch.device) -> tuple[CacheLayout, int]:
    """The cache layout and the max_model_len it serves."""
    free = free_device_bytes(device)
    budget = args.cache_bytes(free)
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = _default_max_model_len(spec, args, budget, free, max_position_embeddings)
    layout = CacheLayout.plan(spec, budget, args.max_num_seqs, max_model_len, args.block_size,
                              args.enable_prefix_caching)
    logger.debug("caches: %s", layout.describe())
    if args.enable_prefix_caching and layout.block_bytes and not layout.num_snapshots:
        logger.warning("enable_prefix_caching: the cache budget of %d bytes leaves no room for a snapshot slot (%d "
                       "bytes) beside the slots and blocks, so no prompt resumes from the cache; raise "
                       "kv_cache_memory_bytes or lower max_num_seqs", budget, layout.slot_bytes)
    return layout, max_model_len


def _default_max_model_len(spec: CacheSpec, args: EngineArgs, budget: int, free: int | None,
                           max_position_embeddings: int) -> int:
    """The smaller of the config's length and the longest sequence `budget` holds, logged in one line."""
    if args.kv_cache_memory_bytes is not None:
        where = "kv_cache_memory_bytes"
    elif free is not None:
        where = f"gpu_memory_utilization={args.gpu_memory_utilization:g} of {free / 2**30:.1f} GiB free"
    else:
        where = "the cpu target's default"
    holds = CacheLayout.longest_sequence(spec, budget, args.max_num_seqs, args.block_size)
    budget_text = f"{budget / 2**20:.0f} MiB ({where})"
    if holds is None:  # no compressed caches: a sequence needs its slot only
        logger.info("max_model_len %d: the config's max_position_embeddings", max_position_embeddings)
        return max_position_embeddings
    if holds < 2:
        raise ValueError(f"a cache budget of {budget_text} holds no sequence beside the slots of max_num_seqs="
                         f"{args.max_num_seqs} sequences: raise kv_cache_memory_bytes or lower max_num_seqs")
    if holds >= max_position_embeddings:
        logger.info("max_model_len %d: the config's max_position_embeddings; the cache budget of %s holds %d tokens "
                    "beside %d sequence slots", max_position_embeddings, budget_text, holds, args.max_num_seqs)
        return max_position_embeddings
    logger.warning("max_model_len %d: the longest sequence the cache budget of %s holds beside %d sequence slots; "
                   "the config allows %d (raise kv_cache_memory_bytes or lower max_num_seqs for more)", holds,
                   budget_text, args.max_num_seqs, max_position_embeddings)
    return holds
