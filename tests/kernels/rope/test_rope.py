"""The rope kernel against `dsl.ops.rope.rotate` (plain and YaRN frequencies, inverse, bf16), and its rows'
independence of the batch; the rope kernel fused with the cache roundings after it (`rope_round`) against the
reference roundings (dsl/ops/rounding.py) of the rope kernel's rows, bit for bit, and against both references."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.dense import rms_norm as ref_rms_norm
from dsl.ops.rope import _freqs_on, inv_freq, rope_params, rotate
from dsl.ops.rounding import fp4_round, fp8_round
from kernels.norm.rms_norm import rms_norm
from kernels.rope.rope import rope, rope_round
from tests.kernels.cases import HEAD_DIM, HEADS, gen, rel_l2
from tests.kernels.rounding.test_rounding import assert_same_bits

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


# (fp8, block, e4m3_scale): the model's three roundings after a rope (fp8 windows; fp4 indexer queries and keys;
# fp4 compressed KV)
ROUNDINGS = [(True, 32, False), (False, 32, False), (False, 16, True)]


def rounded(y: torch.Tensor, fp8: bool, block: int, e4m3_scale: bool) -> torch.Tensor:
    return fp8_round(y, block=block) if fp8 else fp4_round(y, block=block, e4m3_scale=e4m3_scale)


def check_round(x: torch.Tensor, rope_dim: int, params, inverse: bool, fp8: bool, block: int, e4m3_scale: bool,
                tol: float, norm: bool = False, w: torch.Tensor | None = None, bitwise: bool = True) -> None:
    """rope_round(x) (RMS-normed first with `norm`, eps 1e-6): the reference rounding of the rope kernel's rows (of the
    norm kernel's rows with `norm`) on x's device, bit for bit (`bitwise`; else within `tol`, relative L2), and within
    `tol` of the references of all of them (torch's norm, rotation and rounding)."""
    device = x.device
    positions = torch.randint(0, 70000, (x.shape[0],), generator=torch.Generator().manual_seed(2)).to(device)
    freqs, magnitude = _freqs_on(params, rope_dim, device), inv_freq(params, rope_dim)[1]
    got = rope_round(x, positions, freqs, fp8=fp8, block=block, e4m3_scale=e4m3_scale, magnitude=magnitude,
                     inverse=inverse, norm=norm, w=w, eps=1e-6)
    rows = rms_norm(x, w, eps=1e-6) if norm else x
    kernels = rounded(rope(rows, positions, freqs, magnitude=magnitude, inverse=inverse), fp8, block, e4m3_scale)
    if bitwise:
        assert_same_bits(got, kernels)
    else:
        assert rel_l2(got.float(), kernels.float()) < tol
    rows = ref_rms_norm(x.cpu(), None if w is None else w.cpu(), eps=1e-6) if norm else x.cpu()
    want = rounded(rotate(rows, positions.cpu(), params, rope_dim, inverse), fp8, block, e4m3_scale)
    finite = torch.isfinite(want).all(-1)  # blocks holding NaN or inf are compared by the bitwise check
    assert rel_l2(got.cpu()[finite].float(), want[finite].float()) < tol


@pytest.mark.parametrize("fp8,block,e4m3_scale", ROUNDINGS)
@pytest.mark.parametrize("norm", [None, "weight", "no weight"])
@pytest.mark.parametrize("shape,rope_dim,params,inverse", [
    ((1, 64), 16, PLAIN, False),
    ((5, 4, 64), 64, YARN, False),
    ((3, 3, 96), 32, YARN, True),  # rows and D not powers of two: blocks of padding past D
])
def test_rope_round_is_the_rounding_of_rope(fp8, block, e4m3_scale, norm, shape, rope_dim, params, inverse,
                                           device) -> None:
    """fp32 and bf16 rows at scales 1e-6 .. 1e4; a row holding NaN and one holding inf (their blocks as the rounding
    makes them); a row of zeros; normed first or not (with a weight or without)."""
    x = gen(*shape, seed=sum(shape)) * torch.logspace(-6, 4, shape[0]).reshape(-1, *[1] * (len(shape) - 1))
    if shape[0] > 1:
        x.view(shape[0], -1)[0, 1] = float("nan")
        x.view(shape[0], -1)[1, -3] = float("inf")
        x[-1] = 0.0
    w = gen(shape[-1], seed=7, device=device) if norm == "weight" else None
    for dtype, tol in ((torch.float32, 1e-2), (torch.bfloat16, 2e-2)):
        check_round(x.to(dtype).to(device), rope_dim, params, inverse, fp8, block, e4m3_scale, tol, norm is not None, w)


def test_rope_round_without_rounding_norms_and_rotates(device) -> None:
    """block 0 (a dim that is no multiple of the model's block, whose rounding returns x): the norm kernel's rows
    rotated by the rope kernel, bit for bit."""
    x, w = gen(3, 2, 40, seed=4, device=device), gen(40, seed=5, device=device)
    positions = torch.arange(7, 10, device=device)
    freqs = _freqs_on(YARN, 16, torch.device(device))
    got = rope_round(x, positions, freqs, fp8=True, block=0, norm=True, w=w, eps=1e-6)
    assert_same_bits(got, rope(rms_norm(x, w, eps=1e-6), positions, freqs))


def test_rope_round_checks_its_block(device) -> None:
    x, freqs = gen(2, 64, device=device), _freqs_on(PLAIN, 16, torch.device(device))
    positions = torch.zeros(2, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="block must be 0 or a power of two dividing the last dim 64, got 24"):
        rope_round(x, positions, freqs, fp8=True, block=24)
    with pytest.raises(ValueError, match="dividing the last dim 48, got 32"):
        rope_round(gen(2, 48, device=device), positions, freqs, fp8=True, block=32)
    with pytest.raises(ValueError, match="positions must be int64 \\[2\\]"):
        rope_round(x, positions[:1], freqs, fp8=False, block=32)
    with pytest.raises(ValueError, match="norm weight must be contiguous \\[64\\].*go with norm"):
        rope_round(x, positions, freqs, fp8=True, block=32, w=gen(64, device=device))
    with pytest.raises(ValueError, match="norm weight must be contiguous \\[64\\]"):
        rope_round(x, positions, freqs, fp8=True, block=32, norm=True, w=gen(32, device=device))
    assert rope_round(x[:0], positions[:0], freqs, fp8=True, block=32).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 513])
def test_rope_round_v41_shapes(n) -> None:
    """The model's: the window's kv [N, 512] (fp8 / 32, normed first), the indexer's queries [N, 64, 128] and keys
    [E, 128] (fp4, powers of two / 32; the keys normed first), the compressed KV [E, 512] (fp4, e4m3 / 16); rope_dim
    64. Normed rows within the tolerance of the norm kernel's rows rotated and rounded (the fused kernel sums a row's
    squares in its own order, and a code may flip), the rest bit for bit."""
    cases = [((n, HEAD_DIM), ROUNDINGS[0], False), ((n, HEAD_DIM), ROUNDINGS[0], True),
             ((n, 64, 128), ROUNDINGS[1], False), ((n, 128), ROUNDINGS[1], True), ((n, HEAD_DIM), ROUNDINGS[2], False)]
    for shape, (fp8, block, e4m3_scale), norm in cases:
        w = gen(shape[-1], seed=3).cuda() if norm else None
        for dtype, tol in ((torch.float32, 1e-2), (torch.bfloat16, 2e-2)):
            x = gen(*shape, seed=n).to(dtype).cuda()
            check_round(x, 64, YARN, False, fp8, block, e4m3_scale, tol, norm, w, bitwise=not norm)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 513])
def test_rope_v41_shapes(n) -> None:
    check((n, HEADS, HEAD_DIM), 64, YARN, False, torch.float32, "cuda", 1e-6)  # q
    check((n, HEAD_DIM), 64, YARN, False, torch.float32, "cuda", 1e-6)  # the kv entry
    check((n, HEADS, HEAD_DIM), 64, YARN, True, torch.float32, "cuda", 1e-6)  # the output, rotated back
