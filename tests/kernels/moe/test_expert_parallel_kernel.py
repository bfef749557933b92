"""The plan's MoE kernel with its experts split over gloo ranks (kernels/moe/expert_parallel_kernel.py) against the
same kernel on one process: with the batch-invariant config, bitwise, fp4 and float weights, split-K in both GEMMs
(the splits' order is what a per-pair sum would change); outside it, within the kernel's tolerance. Rank 1 has no
tokens in one case: it only serves rank 0's pairs."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.moe.exchange import ExpertExchange
from kernels.moe.expert_parallel_kernel import ParallelMoeKernel
from kernels.moe.experts import moe_experts
from tests.kernels.cases import gen
from tests.kernels.moe.test_experts import LIMIT, make_experts, routing, split

E, INTER, D, K = 8, 64, 64, 3
CONFIG = split(2, 2)  # both GEMMs split: in batch-invariant mode the partials travel back unsummed


def _case(fmt: str, tokens: tuple[int, ...]) -> tuple[list, list, list[tuple]]:
    """Every rank's inputs, drawn alike on every rank: the experts, and per rank (x, weights, experts)."""
    ws, ss = make_experts(E, INTER, D, fmt, "cpu")
    per_rank = []
    for r, t in enumerate(tokens):
        weights, experts = routing(t, E, K, "cpu", seed=10 + r)
        per_rank.append((gen(t, D, device="cpu", seed=20 + r), weights, experts))
    return ws, ss, per_rank


def _shard(t: torch.Tensor | None, rank: int, world: int) -> torch.Tensor | None:
    if t is None:
        return None
    share = t.shape[0] // world
    return t[rank * share:(rank + 1) * share].contiguous()


def _rank(rank: int, world: int, port: int, fmt: str, tokens: tuple[int, ...], invariant: bool, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        ws, ss, per_rank = _case(fmt, tokens)
        x, weights, experts = per_rank[rank]
        dot_fp32 = fmt == "fp32"
        kernel = ParallelMoeKernel(ExpertExchange())
        mine = [_shard(w, rank, world) for w in ws], [_shard(s, rank, world) for s in ss]
        got = kernel(x, weights, experts, *mine[0], *mine[1], limit=LIMIT, config_for=lambda m: CONFIG,
                     invariant=invariant, dot_fp32=dot_fp32)
        want = moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=CONFIG, dot_fp32=dot_fp32)
        out.put((rank, torch.equal(got, want), float((got - want).norm() / want.norm().clamp_min(1e-30)), None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((rank, False, 0.0, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def _run(world: int, fmt: str, tokens: tuple[int, ...], invariant: bool) -> list[tuple]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, fmt, tokens, invariant, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert [r[3] for r in results] == [None] * world, results
    return results


@pytest.mark.parametrize("fmt,tokens", [("fp4", (5, 3)), ("bf16", (4, 0)), ("fp32", (2, 6))])
def test_two_ranks_give_one_process_s_bits_with_the_invariant_config(fmt, tokens) -> None:
    results = _run(2, fmt, tokens, invariant=True)
    assert all(equal for _, equal, _, _ in results), results


def test_two_ranks_outside_invariant_mode_agree_within_tolerance() -> None:
    results = _run(2, "fp4", (5, 3), invariant=False)
    assert all(err < 1e-6 for _, _, err, _ in results), results


def test_one_rank_is_the_single_device_kernel() -> None:
    """World size 1: every pair stays on this rank and the sum is the kernel's own."""
    results = _run(1, "fp4", (7,), invariant=True)
    assert results[0][1]


def test_expert_ids_past_the_ranks_are_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="expert id 9 is past the 8 experts of 1 ranks"):
            ExpertExchange().plan(torch.tensor([[1, 9]]), 8)
    finally:
        dist.destroy_process_group()
