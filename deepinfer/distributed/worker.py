"""The body of a rank process spawned by `SpawnedLLM` (deepinfer/distributed/spawned_llm.py).

It joins the group, builds its `RankLLM`, says so, then runs each call it is given until told to stop (None). Every
answer is (rank, error or None, value): rank 0's value is the engine's max_model_len once built, then each call's
outputs. An exception is reported with its
traceback and ends the process with code 1; its departure ends the other ranks' collectives at once.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch.multiprocessing as mp


def run_rank(rank: int, world_size: int, port: int, build: dict[str, Any], commands: mp.Queue,
             results: mp.Queue) -> None:
    from deepinfer.cpu_threads import usable_cores
    from deepinfer.distributed import ranks
    from deepinfer.distributed.spawned_llm import format_error
    from kernels.targets import DEFAULT_TARGET

    code = 0
    try:
        if "OMP_NUM_THREADS" not in os.environ:  # the host's cores shared between the ranks
            import torch

            threads = max(1, usable_cores() // world_size)
            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        device = ranks.group_device(build.get("target", DEFAULT_TARGET), build.get("device", "cpu"))
        ranks.join(ranks.RankInfo(rank, world_size, rank), device, f"tcp://127.0.0.1:{port}")
        from deepinfer.distributed.rank_llm import RankLLM

        llm = RankLLM(**build)
        results.put((rank, None, llm.max_model_len))
        while (command := commands.get()) is not None:
            prompts, params = command
            outputs = llm.generate(prompts, params, use_tqdm=False)
            results.put((rank, None, outputs if rank == 0 else None))
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent, then ends the rank
        results.put((rank, format_error(e), None))
        code = 1
    results.close()
    results.join_thread()
    sys.stdout.flush()
    os._exit(code)  # no teardown that waits on the other ranks
