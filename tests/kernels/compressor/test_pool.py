"""The compressor's pooling kernel against `dsl.ops.compressor`'s torch: groups of forward and kept rows, ratios 2 to
128, a group's entry the same bits in any batch, and the paged batch's pooling through `pool_entries` over a random
schedule of prefills and decodes (tests/test_paged_batched.py's)."""

from __future__ import annotations

import pytest
import torch

from dsl.context import ForwardContext
from dsl.ops.compressor import pool_entries, pool_rows
from kernels.compressor.pool import pool_groups
from tests.kernels.cases import gen, rel_l2


def groups(n: int, kept: int, count: int, ratio: int, d: int, device: str, seed: int = 0) -> tuple:
    kv, gate = gen(n, d, device=device, seed=seed), 3 * gen(n, d, device=device, seed=seed + 1)
    kept_kv, kept_gate = gen(kept, d, device=device, seed=seed + 2), 3 * gen(kept, d, device=device, seed=seed + 3)
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(0, n + kept, (count, ratio), generator=g).to(device)
    return kv, gate, kept_kv, kept_gate, source


@pytest.mark.parametrize("n,kept,count,ratio,d", [(9, 3, 4, 2, 64), (20, 0, 5, 4, 40), (3, 130, 2, 128, 24),
                                                  (1, 0, 0, 4, 64)])
def test_pool_groups_match_torch(n, kept, count, ratio, d, device) -> None:
    args = groups(n, kept, count, ratio, d, device)
    got = pool_groups(*args, config={"block_D": 16, "num_warps": 4})  # several column blocks, a partial one at 40
    want = pool_rows(*args)
    assert got.shape == want.shape == (count, d)
    if count:
        assert rel_l2(got, want) < 1e-6, rel_l2(got, want)


def test_a_group_is_the_same_bits_alone_and_among_others(device) -> None:
    kv, gate, kept_kv, kept_gate, source = groups(12, 4, 6, 4, 64, device, seed=5)
    every = pool_groups(kv, gate, kept_kv, kept_gate, source)
    for g in range(source.shape[0]):
        assert torch.equal(pool_groups(kv, gate, kept_kv, kept_gate, source[g:g + 1])[0], every[g])


def test_bad_arguments_name_the_argument(device) -> None:
    kv, gate, kept_kv, kept_gate, source = groups(4, 2, 1, 2, 32, device)
    with pytest.raises(ValueError, match="gate"):
        pool_groups(kv, gate[:, :16], kept_kv, kept_gate, source)
    with pytest.raises(ValueError, match="source"):
        pool_groups(kv, gate, kept_kv, kept_gate, source.int())


def test_paged_batches_pool_on_the_kernel_as_in_torch(monkeypatch) -> None:
    """A random schedule of prefills and decodes, sequences in shared pools pooling on the kernel against sequences
    with caches of their own pooling in torch: at every step the ratio-4 and ratio-128 layers' entries agree up to
    rounding (the same partial rows read and written: every later step's too)."""
    from tests.test_paged_batched import OPS_REF, play

    monkeypatch.setattr(ForwardContext, "compute_per_chunk", property(lambda self: False))
    ops = dict(OPS_REF, compress_pool=lambda *a, **k: pool_entries(*a, **k, pool_groups=pool_groups))
    pooled = []

    def check(got, want, contexts, inputs):
        for name in ("pooled2", "pooled3"):
            assert (got[name].counts, got[name].first) == (want[name].counts, want[name].first)
            assert torch.allclose(got[name].values, want[name].values, rtol=1e-6, atol=1e-6), name
            pooled.append(got[name].values.shape[0])

    play(6, num_seqs=4, steps=6, device="cpu", check=check, paged_ops=ops)
    assert sum(pooled) > 0  # groups completed, through the kernel


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,count", [(4, 1), (4, 300), (128, 3)])
def test_pool_groups_at_v41_shapes_on_the_gpu(ratio, count) -> None:
    """V4.1's compressors (ratios 4 and 128, head_dim 512): a decode step's one group, a prefill's many."""
    args = groups(ratio * count, ratio - 1, count, ratio, 512, "cuda", seed=ratio)
    got, want = pool_groups(*args), pool_rows(*args)
    assert rel_l2(got, want) < 1e-6, rel_l2(got, want)
    assert torch.equal(pool_groups(*args[:4], args[4][-1:])[0], got[-1])
