"""Several devices: expert parallelism with data-parallel attention over torch.distributed.

    ranks.py        this process as a rank: its device and the process group (gloo on the cpu, NCCL on GPUs)
    rank_llm.py     one rank's LLM: its share of the routed experts and of the requests, outputs gathered
    spawned_llm.py  `LLM(..., expert_parallel_size=N)` outside any rank: spawns N ranks and watches them
    worker.py       the body of a spawned rank's process

The routed experts' exchange is kernels/moe/expert_parallel.py; the ranks' agreement before each forward is
graphs/lockstep.py.
"""

from __future__ import annotations

from deepinfer.distributed import ranks


def parallel_llm_class() -> type:
    """The LLM class for `expert_parallel_size` > 1: a rank's own when this process is one, else the spawner."""
    if ranks.current() is not None or ranks.started_by_torchrun():
        from deepinfer.distributed.rank_llm import RankLLM

        return RankLLM
    from deepinfer.distributed.spawned_llm import SpawnedLLM

    return SpawnedLLM


__all__ = ["parallel_llm_class"]
