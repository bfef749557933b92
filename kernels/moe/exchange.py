"""The routed experts' exchange (expert parallelism): each (token, expert) pair to the rank holding its expert and back.

Rank r of N holds experts [r * E / N, (r + 1) * E / N) of every MoE layer. `ExpertExchange.plan` groups a forward's
pairs by the rank owning their expert (a stable sort, so each rank's pairs stay in pair order) and swaps the counts
with every rank; `send` carries per-pair columns of any dtypes to their owners in one `all_to_all_single` of bytes
(the columns side by side in each row, so nothing is converted: bf16 rows arrive as the bf16 the kernel reads);
`gather` carries each arrived pair's result back and puts it at its pair's place. A rank with no tokens still plans
and sends zero rows: its experts serve the others. Both the interpreter's experts (kernels/moe/expert_parallel.py)
and the plan's MoE kernel (kernels/moe/expert_parallel_kernel.py) exchange through it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Route:
    """One forward's pairs on their way: `order` [P] the pair ids grouped by destination rank (pair order within),
    `local` [P] int64 each pair's expert id on its owner (in pair order), `send` / `recv` the rows to and from each
    rank."""

    order: torch.Tensor
    local: torch.Tensor
    send: list[int]
    recv: list[int]

    @property
    def num_arrived(self) -> int:
        return sum(self.recv)


class ExpertExchange:
    """The pairs' exchange over `group` (None: the default group)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def plan(self, experts: torch.Tensor, num_local: int) -> Route:
        """The route of the pairs of experts int [N, k] (global ids, token-major pair order) over ranks holding
        `num_local` experts each; swaps the counts with every rank."""
        if num_local < 1:
            raise ValueError(f"a rank must hold at least one expert, got {num_local}")
        pairs = experts.reshape(-1).long()
        owner = torch.div(pairs, num_local, rounding_mode="floor")
        send = torch.bincount(owner, minlength=self.world_size)
        if send.numel() > self.world_size:  # longer only where some owner is past the last rank
            raise ValueError(f"expert id {int(pairs.max())} is past the {num_local * self.world_size} experts of "
                             f"{self.world_size} ranks holding {num_local} each")
        order = torch.argsort(owner, stable=True)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        return Route(order, pairs - owner * num_local, send.tolist(), recv.tolist())

    def send(self, route: Route, columns: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-pair columns [P, ...] (in `route.order` already) to their owners, one all-to-all; returns the arrived
        columns [pairs from every rank, ...], rank by rank, each rank's in its pair order."""
        return self._swap(columns, route.recv, route.send)

    def gather(self, route: Route, rows: torch.Tensor) -> torch.Tensor:
        """Each arrived pair's result rows [arrived, ...] back to the rank it came from, at its pair's place:
        [P, ...] in pair order."""
        (back,) = self._swap([rows], route.send, route.recv)
        out = torch.empty_like(back)
        out[route.order] = back
        return out

    def _swap(self, columns: list[torch.Tensor], recv: list[int], send: list[int]) -> list[torch.Tensor]:
        """One all_to_all_single of the columns' bytes side by side: row i's bytes are each column's row i."""
        rows = columns[0].shape[0]
        flat = [c.contiguous().view(rows, math.prod(c.shape[1:])) for c in columns]
        raw = [f.view(torch.uint8) if f.numel() else f.new_empty((rows, f.shape[1] * f.element_size()),
                                                                 dtype=torch.uint8) for f in flat]
        widths = [r.shape[1] for r in raw]
        payload = torch.cat(raw, dim=1) if len(raw) > 1 else raw[0]
        arrived = payload.new_empty((sum(recv), payload.shape[1]))
        dist.all_to_all_single(arrived, payload.contiguous(), recv, send, group=self.group)
        out, start = [], 0
        for c, f, width in zip(columns, flat, widths, strict=True):
            part = arrived[:, start:start + width].clone(memory_format=torch.contiguous_format)  # offset 0: aligned
            values = part.view(f.dtype) if part.numel() else part.new_empty((0, f.shape[1]), dtype=f.dtype)
            out.append(values.view(arrived.shape[0], *c.shape[1:]))
            start += width
        return out


__all__ = ["ExpertExchange", "Route"]
