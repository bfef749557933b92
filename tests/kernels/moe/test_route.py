"""The routing kernels against the torch layout (`route_ref`), bit for bit: distinct and repeated experts a token,
blocks of 1 to 64 slots, expert counts that are not a power of two, one token, every token on the same experts,
scans over several blocks of pairs; every pair laid out once in blocks of one expert; V4.1's sizes on the GPU, and
the layout captured in a CUDA graph (no host sync) and replayed on other picks."""

from __future__ import annotations

import pytest
import torch

from kernels.moe.route import route, route_ref
from tests.kernels.cases import EXPERTS, TOPK

SMALL = {"block_P": 16, "num_warps": 4}  # 16 pairs a scan step: most cases take several


def picks(t: int, e: int, k: int, device: str, seed: int = 0, how: str = "distinct") -> torch.Tensor:
    """experts int64 [t, k]: k distinct a token (the gate's), any (`repeated`), or every token the same (`same`)."""
    g = torch.Generator().manual_seed(seed)
    if how == "repeated":
        return torch.randint(0, e, (t, k), generator=g).to(device)
    experts = torch.rand(t, e, generator=g).argsort(dim=1)[:, :k]
    return (experts[:1].expand(t, k).contiguous() if how == "same" else experts).to(device)


def check(experts: torch.Tensor, e: int, block_m: int, config: dict | None = None) -> None:
    rows, block_expert = route(experts, e, block_m, config)
    want_rows, want_block_expert = route_ref(experts, e, block_m)
    assert rows.dtype == block_expert.dtype == torch.int32
    assert torch.equal(rows, want_rows) and torch.equal(block_expert, want_block_expert)


@pytest.mark.parametrize("how", ["distinct", "repeated", "same"])
@pytest.mark.parametrize("t,e,k,block_m", [(1, 6, 2, 16), (9, 8, 3, 4), (20, 13, 4, 4), (33, 5, 2, 1),
                                           (40, 7, 3, 16), (21, 6, 2, 64), (3, 100, 6, 16)])
def test_route_matches_torch(how, t, e, k, block_m, device) -> None:
    check(picks(t, e, k, device, seed=t + e, how=how), e, block_m, SMALL)


def test_route_default_config_and_int32_experts(device) -> None:
    experts = picks(50, 12, 4, device, seed=1)
    check(experts, 12, 16)
    assert all(torch.equal(a, b) for a, b in zip(route(experts.int(), 12, 16), route_ref(experts, 12, 16),
                                                 strict=True))


def test_route_lays_out_every_pair_once_in_blocks_of_one_expert(device) -> None:
    experts = picks(9, 8, 3, device, seed=3)
    rows, block_expert = (t.cpu() for t in route(experts, 8, 4, SMALL))
    pairs = rows[rows >= 0]
    assert sorted(pairs.tolist()) == list(range(27))
    flat = experts.reshape(-1).cpu()
    for b, e in enumerate(block_expert.tolist()):
        block = rows[4 * b: 4 * b + 4]
        assert all(flat[p] == e for p in block[block >= 0].tolist())
        assert e >= 0 or (block < 0).all()
    assert (block_expert < 0).any()  # the bound leaves unused blocks here: they are -1 too


def test_route_empty_and_bad_arguments(device) -> None:
    rows, block_expert = route(torch.empty(0, 3, dtype=torch.int64, device=device), 8, 4)
    assert rows.shape == block_expert.shape == (0,)
    with pytest.raises(ValueError, match="experts"):
        route(torch.zeros(4, 2, device=device), 8, 4)
    with pytest.raises(ValueError, match="block_m"):
        route(picks(4, 8, 2, device), 8, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64, 8192])
@pytest.mark.parametrize("block_m", [16, 64])
def test_route_v41_shapes_on_the_gpu(t, block_m) -> None:
    """384 experts top 6 in the experts' two block sizes (decode 16 slots, prefill 64); every token on the same 6
    experts too (long runs of one expert's blocks, and many unused ones)."""
    check(picks(t, EXPERTS, TOPK, "cuda", seed=t), EXPERTS, block_m)
    check(picks(t, EXPERTS, TOPK, "cuda", seed=t, how="same"), EXPERTS, block_m)


@pytest.mark.gpu
def test_route_is_captured_by_a_cuda_graph() -> None:
    """No host sync: captured once, replayed on other picks, the layout of each."""
    experts = picks(64, EXPERTS, TOPK, "cuda", seed=0)
    route(experts, EXPERTS, 16)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows, block_expert = route(experts, EXPERTS, 16)
    for seed in (1, 2):
        experts.copy_(picks(64, EXPERTS, TOPK, "cuda", seed=seed))
        graph.replay()
        want_rows, want_block_expert = route_ref(experts, EXPERTS, 16)
        assert torch.equal(rows, want_rows) and torch.equal(block_expert, want_block_expert)
