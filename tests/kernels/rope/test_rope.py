"""The rope kernel against `dsl.ops.rope.rotate` (plain and YaRN frequencies, inverse, bf16), and its rows'
independence of the batch."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.rope import _freqs_on, inv_freq, rope_params, rotate
from kernels.rope.rope import rope
from tests.kernels.cases import HEAD_DIM, HEADS, gen, rel_l2

PLAIN = rope_params({"rope_theta": 10000.0})
YARN = rope_params({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
                    "original_max_position_embeddings": 4096, "attention_factor": 1.3})


def check(shape: tuple[int, ...], rope_dim: int, params, inverse: bool, dtype: torch.dtype, device: str,
          tol: float) -> None:
    x = gen(*shape, dtype=dtype, device=device, seed=sum(shape))
    positions = torch.randint(0, 70000, (shape[0],), generator=torch.Generator().manual_seed(1)).to(device)
    freqs = _freqs_on(params, rope_dim, torch.device(device))
    got = rope(x, positions, freqs, magnitude=inv_freq(params, rope_dim)[1], inverse=inverse)
    want = rotate(x.cpu(), positions.cpu(), params, rope_dim, inverse)
    assert got.shape == want.shape and got.dtype == want.dtype
    nope = shape[-1] - rope_dim
    assert torch.equal(got[..., :nope].cpu(), x[..., :nope].cpu())  # the unrotated dims are copied as they are
    assert rel_l2(got.float(), want.float()) < tol


@pytest.mark.parametrize("shape,rope_dim,params,inverse", [
    ((1, 64), 16, PLAIN, False),
    ((5, 4, 64), 16, YARN, False),
    ((3, 3, 40), 16, YARN, True),  # rows and D not powers of two
    ((2, 8, 32), 32, PLAIN, True),  # every dim rotated
])
def test_rope_matches_reference(shape, rope_dim, params, inverse, device) -> None:
    check(shape, rope_dim, params, inverse, torch.float32, device, 1e-6)


def test_rope_bf16(device) -> None:
    check((4, 2, 64), 16, YARN, False, torch.bfloat16, device, 1e-2)


def test_rope_rows_do_not_depend_on_the_batch(device) -> None:
    x = gen(6, 4, 64, device=device, seed=3)
    positions = torch.arange(100, 106, device=device)
    freqs = _freqs_on(YARN, 16, torch.device(device))
    batch = rope(x, positions, freqs)
    assert torch.equal(rope(x[2:3].contiguous(), positions[2:3].contiguous(), freqs)[0], batch[2])
    padded = torch.cat([x, torch.full((3, 4, 64), float("nan"), device=device)])
    assert torch.equal(rope(padded, torch.cat([positions, positions.new_zeros(3)]), freqs)[:6], batch)


def test_rope_checks_its_inputs(device) -> None:
    x, freqs = gen(2, 64, device=device), _freqs_on(PLAIN, 16, torch.device(device))
    with pytest.raises(ValueError, match="positions must be int64 \\[2\\]"):
        rope(x, torch.zeros(3, dtype=torch.long, device=device), freqs)
    with pytest.raises(ValueError, match="freqs must be contiguous float32"):
        rope(x, torch.zeros(2, dtype=torch.long, device=device), freqs.double())
    with pytest.raises(ValueError, match="contiguous float32/bfloat16 x"):
        rope(x.t(), torch.zeros(64, dtype=torch.long, device=device), freqs)
    assert rope(x[:0], torch.zeros(0, dtype=torch.long, device=device), freqs).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 513])
def test_rope_v41_shapes(n) -> None:
    check((n, HEADS, HEAD_DIM), 64, YARN, False, torch.float32, "cuda", 1e-6)  # q
    check((n, HEAD_DIM), 64, YARN, False, torch.float32, "cuda", 1e-6)  # the kv entry
    check((n, HEADS, HEAD_DIM), 64, YARN, True, torch.float32, "cuda", 1e-6)  # the output, rotated back
