"""This process as one rank of several: who it is, its device, and the process group every rank joins.

A rank is started either by `LLM(..., expert_parallel_size=N)` itself (deepinfer/distributed/spawned_llm.py: N
processes on this host, torch.multiprocessing with spawn) or by `torchrun`, whose RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT it reads. The group is gloo on the cpu and NCCL on CUDA devices; its collectives give up
after `COLLECTIVE_TIMEOUT`, so a rank that stops answering ends the job rather than hanging it.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.targets import INTERPRETER, get_target

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
_ENV = ("RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int  # the device index on its host

    def device(self, device: str) -> str:
        """The torch device this rank runs `device` ("cpu" or "cuda") on: its own GPU of the host's."""
        return f"cuda:{self.local_rank}" if torch.device(device).type == "cuda" else device


_current: RankInfo | None = None


def current() -> RankInfo | None:
    """This process's rank once `join` ran, else None."""
    return _current


def group_device(target: str, device: str) -> str:
    """The device kind a rank of `target` runs on: a GPU target's plans on CUDA (NCCL), the cpu target's runtime on
    `device` (gloo on the cpu)."""
    return device if get_target(target).runtime == INTERPRETER else "cuda"


def started_by_torchrun() -> bool:
    return all(name in os.environ for name in _ENV)


def join(info: RankInfo, device: str, init_method: str = "env://") -> RankInfo:
    """Join the ranks' process group as `info` (gloo for the cpu, NCCL for CUDA devices) unless joined already."""
    global _current
    if not dist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(info.local_rank)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=info.rank,
                                world_size=info.world_size, timeout=COLLECTIVE_TIMEOUT)
    elif (dist.get_rank(), dist.get_world_size()) != (info.rank, info.world_size):
        raise RuntimeError(f"the process group is rank {dist.get_rank()} of {dist.get_world_size()}, not rank "
                           f"{info.rank} of {info.world_size}")
    _current = info
    return info


def free_port() -> int:
    """A port on this host that is free now, for the ranks' rendezvous (tcp://127.0.0.1:port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_alone(device: str) -> RankInfo:
    """Join a process group of this process alone (world size 1): the distributed path on one device."""
    return join(RankInfo(0, 1, 0), device, f"tcp://127.0.0.1:{free_port()}")


def leave() -> None:
    """Leave the process group: this process is no rank any more."""
    global _current
    if dist.is_initialized():
        dist.destroy_process_group()
    _current = None


def from_torchrun() -> RankInfo:
    """The rank torchrun started this process as."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return RankInfo(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


__all__ = ["COLLECTIVE_TIMEOUT", "RankInfo", "current", "free_port", "from_torchrun", "group_device", "join",
           "join_alone", "leave", "started_by_torchrun"]
