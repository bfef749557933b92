"""The index tensors and rotations that eager cache-side ops make once per forward (`ForwardContext.memo`) and share
between layers: a later layer, with other values or another layout, gets what a fresh forward would give it; and the
pairwise rotation is bitwise the written-out formula."""

from __future__ import annotations

import random

import pytest
import torch

from dsl.context import ForwardContext, SequenceState
from dsl.ops.attention import visible_entries
from dsl.ops.rope import _freqs_on, inv_freq, rope_entries, rope_params, rotate
from dsl.ragged import Ragged
from tests.test_paged_batched import OPS_REF, TOPK, WINDOW, Twin, make_inputs, next_step, run_ops

YARN = rope_params({"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "rope_theta": 160000.0,
                    "original_max_position_embeddings": 65536, "attention_factor": 1.3})
PLAIN = rope_params({"rope_theta": 10000.0})


def written_out(x: torch.Tensor, positions: torch.Tensor, params, rope_dim: int, inverse: bool) -> torch.Tensor:
    """The rotation as V41_SPEC.md writes it: (even, odd) -> (even cos - odd sin, even sin + odd cos)."""
    magnitude = inv_freq(params, rope_dim)[1]
    angles = positions.float()[:, None] * _freqs_on(params, rope_dim, x.device)[None, :]
    cos, sin = angles.cos() * magnitude, angles.sin() * magnitude * (-1 if inverse else 1)
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    even, odd = x[..., -rope_dim::2].float(), x[..., -rope_dim + 1::2].float()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("params", [YARN, PLAIN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 64), (5, 3, 80), (0, 64), (9, 2, 4, 48)])
def test_rotate_is_bitwise_the_written_out_formula(params, dtype, shape) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    for inverse in (False, True):
        x = (torch.randn(shape, generator=gen) * 10).to(dtype)
        x.view(-1)[::7], x.view(-1)[::11] = 0.0, -0.0  # signed zeros: a - b and a + (-b) must agree on them too
        positions = torch.randint(0, 100000, (shape[0],), generator=gen)
        assert torch.equal(bits(rotate(x, positions, params, 32, inverse)),
                           bits(written_out(x, positions, params, 32, inverse)))


def test_rope_entries_of_two_layouts_in_one_forward() -> None:
    """Entries of ratio 2 then 4 (other first indices and counts) and again 2 with other values, in one context: each
    rotated at its own positions, entry j of ratio r at j * r."""
    states = [SequenceState(num_tokens=n) for n in (0, 17, 300)]
    ctx = ForwardContext(states, [5, 1, 9])
    gen = torch.Generator().manual_seed(0)
    for ratio, first, counts in ((2, [0, 8, 150], [2, 1, 4]), (4, [0, 4, 75], [1, 0, 2]), (2, [0, 8, 150], [2, 1, 4])):
        values = torch.randn(sum(counts), 3, 48, generator=gen)
        got = rope_entries(Ragged(values, counts, first), params=YARN, rope_dim=32, ratio=ratio, ctx=ctx)
        positions = torch.tensor([(f + j) * ratio for f, n in zip(first, counts) for j in range(n)])
        assert torch.equal(got.values, written_out(values, positions, YARN, 32, inverse=False))
        assert (got.counts, got.first) == (counts, first)


@pytest.mark.parametrize("seed", [0, 1])
def test_visible_entries_of_each_layer_as_in_a_fresh_forward(seed: int) -> None:
    """Two layers' picks over a window view and a draft block's view (causal or not) in one paged forward: the entry lists and keys are those a fresh
    context gives, in int32 as in int64."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    twin = Twin(4, rng, "cpu")
    for _ in range(4):
        step = next_step(rng, twin)
        lengths = [n for _, n in step]
        states = [twin.paged[i] for i, _ in step]
        ctx = ForwardContext(states, lengths)
        out = run_ops(ctx, make_inputs(sum(lengths), gen, "cpu"), OPS_REF)
        width = max(out["kv2"].lengths)
        for window, causal in ((out["window0"], True), (out["block0"], True), (out["block0"], False)):
            for _ in range(2):
                picks = torch.randint(-1, max(width, 1), (sum(lengths), TOPK), generator=gen)
                picks = torch.minimum(picks, torch.tensor(out["kv2"].lengths)[ctx.row_chunks][:, None] - 1)
                want = visible_entries(window, out["kv2"], picks, window_size=WINDOW, causal=causal,
                                       ctx=ForwardContext(states, lengths), dtype=torch.float32)
                for index_dtype in (torch.int64, torch.int32):
                    kv, idx = visible_entries(window, out["kv2"], picks, window_size=WINDOW, causal=causal, ctx=ctx,
                                              dtype=torch.float32, index_dtype=index_dtype)
                    assert idx.dtype == index_dtype and torch.equal(idx.long(), want[1]) and torch.equal(kv, want[0])
        ctx.commit()
