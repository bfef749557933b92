"""Tickets: a launch whose programs each write a partial, and whose last program to finish combines them, in one launch
instead of a second one that reads the partials back.

Each program stores its partial, then takes a ticket from its tile's counter (`last_arrival`); the program holding
the last ticket reads the tile's partials (from L2, `.cg`, where the other programs' stores went), combines them in a
fixed order, so the same bits whichever program finishes last, and sets the counter back to zero. The counters
(`tile_counters`) are one zeroed int32 buffer a device, shared by every launch that uses them: the launches of a
stream run one after another, and each leaves every counter at zero. Users: the one-row linear kernels' K splits
(kernels/linear/gemv.py), one token's routed experts summed over its slots (kernels/moe/experts.py), one token's gate
(kernels/moe/gate.py) and hyper-connection mixes (kernels/hyper/mixes.py).
"""

from __future__ import annotations

import torch

from kernels.lang import tl, triton

COUNTERS = 4096  # tiles a launch that combines inside may have (a split one has fewer than 2 programs per SM)


@triton.jit
def last_arrival(count_ptr, tile, arrivals: tl.constexpr):
    """Whether this program is the last of `arrivals` to take a ticket from counter `tile`, its partial already
    stored. The caller's last program sets the counter back to zero (`tl.atomic_xchg`) once it has read the
    partials."""
    tl.debug_barrier()  # every thread's partial is written before the ticket (released at GPU scope) is taken
    return tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu") == arrivals - 1


_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's `COUNTERS` zeroed int32 tile counters, made on first use, for a launch of `tiles` tiles that
    combines its partials inside (ValueError past `COUNTERS`). Made during a CUDA graph's capture, they come from the
    graph's pool with a zeroing node: still zero at each launch, since every launch leaves them so."""
    if tiles > COUNTERS:
        raise ValueError(f"{tiles} output tiles combined in one launch: at most {COUNTERS} (tickets.COUNTERS)")
    counters = _counters.get(device)
    if counters is None:
        counters = _counters[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return counters


__all__ = ["COUNTERS", "last_arrival", "tile_counters"]
