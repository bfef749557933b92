"""Host-to-device copies of a forward's small index tensors, queued without the host waiting for the device."""

from __future__ import annotations

import torch


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host ints on `device`, copied without waiting for the device's queued work."""
    return host_to(torch.tensor(values, dtype=torch.long), device)


def host_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on `device`, queued behind the device's work without the host waiting for it. For CUDA
    the copy goes from pinned memory (torch's cached host allocator keeps the block until the copy is done): a copy
    from pageable memory may make the driver wait for the stream first, and then the host's next launches find the
    GPU idle."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
