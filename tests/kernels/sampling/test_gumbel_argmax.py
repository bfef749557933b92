"""The sampling kernel against deepinfer/sampler.py's torch draw (`sample_plain_torch`, whose rows are `sample`'s):
the hash bitwise and the noise within an ulp (numpy's log under the interpreter; the GPU's is torch's, bitwise),
tokens bitwise over many seeds, temperatures, -inf, NaN and all -inf rows, greedy rows and ties, a row the same
alone and in any batch or block size, and at V4.1's vocabulary on the GPU, JIT and ahead-of-time cubins alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.sampler import _int64, gumbel_noise, hash_uniform, mix64, sample_plain, sample_plain_torch
from kernels.lang import tl, triton
from kernels.launch import is_jit, use_launcher
from kernels.sampling.gumbel_argmax import KERNEL_NAMES, _gumbel, _mix64, gumbel_argmax

VOCAB = 129280  # V4.1-Flash's vocab_size


@triton.jit
def noise_kernel(seeds_ptr, positions_ptr, hash_ptr, noise_ptr, V: tl.constexpr, block_V: tl.constexpr):
    """The kernel's hash of every token of row r and its Gumbel noise, [R, V] each."""
    r = tl.program_id(0)
    ids = tl.program_id(1) * block_V + tl.arange(0, block_V)
    key = _mix64(_mix64(tl.load(seeds_ptr + r)) + tl.load(positions_ptr + r))
    tl.store(hash_ptr + r * V + ids, _mix64(key + ids.to(tl.int64)), mask=ids < V)
    tl.store(noise_ptr + r * V + ids, _gumbel(key, ids.to(tl.int64)), mask=ids < V)


def kernel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, block_V: int = 256) -> tuple:
    rows = seeds.shape[0]
    h = torch.empty(rows, vocab, dtype=torch.int64, device=seeds.device)
    noise = torch.empty(rows, vocab, dtype=torch.float64, device=seeds.device)
    noise_kernel[(rows, triton.cdiv(vocab, block_V))](seeds, positions, h, noise, V=vocab, block_V=block_V)
    return h, noise


def draw_args(rows: int, vocab: int, device: str, seed: int = 0, dtype: torch.dtype = torch.float32,
              greedy_every: int = 5) -> tuple:
    """Logits [rows, vocab] (scale 4) with -inf and NaN holes, rows all -inf, all -inf but a NaN, and equal maxima;
    temperatures 0.05 to 3 (every `greedy_every`-th row 0: greedy), seeds over the whole int64 range."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    holes = torch.rand(rows, vocab, generator=g)
    logits[holes < 0.3] = float("-inf")
    logits[holes > 0.999] = float("nan")
    if rows > 4:
        logits[1] = float("-inf")
        logits[2] = float("-inf")
        logits[2, vocab // 2] = float("nan")
        logits[4] = logits[4].nan_to_num(nan=0.0)
        logits[4, vocab // 3] = logits[4, vocab - 1] = 50.0  # equal maxima of a greedy row: the lower id
    temperatures = (0.05 + 2.95 * torch.rand(rows, generator=g, dtype=torch.float64)).tolist()
    temperatures = [0.0 if r % greedy_every == greedy_every - 1 else t for r, t in enumerate(temperatures)]
    seeds = torch.randint(-(2**63), 2**63 - 1, (rows,), generator=g).tolist()
    positions = torch.randint(0, 1 << 20, (rows,), generator=g).tolist()
    return logits.to(dtype).to(device), temperatures, seeds, positions


def on_device(temperatures: list[float], seeds: list[int], positions: list[int], device: str) -> tuple:
    factors = torch.tensor([0.0 if t == 0 else 1.0 / t for t in temperatures], dtype=torch.float64, device=device)
    return factors, torch.tensor(seeds, device=device), torch.tensor(positions, device=device)


def test_hash_bitwise_and_noise_as_the_logs_allow(device) -> None:
    seeds = torch.tensor([0, -1, -(2**63), 2**63 - 1, 12345, -987654321], device=device)
    positions = torch.tensor([0, 7, 1 << 40, 3, 2**63 - 1, 100], device=device)
    vocab = 1000
    h, noise = kernel_noise(seeds, positions, vocab)
    key = mix64(mix64(seeds) + positions)
    assert torch.equal(h, mix64(key[:, None] + torch.arange(vocab, device=device)[None, :]))
    want = gumbel_noise(seeds, positions, vocab)
    if device == "cuda":  # libdevice's log, as torch's CUDA log
        assert torch.equal(noise, want)
        return
    u = hash_uniform(seeds, positions, vocab).numpy()
    assert torch.equal(noise, torch.from_numpy(-np.log(-np.log(u))))  # the interpreter's log is numpy's
    # numpy's and torch's logs may differ by an ulp; one of the inner log v = -log(u) moves -log(v) by ulp(v) / v
    ulp = torch.nextafter(want.abs(), torch.full_like(want, float("inf"))) - want.abs()
    assert bool(((noise - want).abs() <= ulp + 2.0**-52).all())


@pytest.mark.parametrize("rows,vocab,block_V,dtype", [(40, 300, 64, torch.float32), (12, 1000, 128, torch.bfloat16),
                                                      (1, 77, 32, torch.float32), (9, 5, 4, torch.float32)])
def test_tokens_are_the_torch_draws(rows, vocab, block_V, dtype, device) -> None:
    """Vocabularies that are not a multiple of the block; greedy rows among sampled ones."""
    for seed in range(3):
        logits, temperatures, seeds, positions = draw_args(rows, vocab, device, seed, dtype)
        got = gumbel_argmax(logits, *on_device(temperatures, seeds, positions, device),
                            config={"block_V": block_V, "num_warps": 4})
        want = sample_plain_torch(logits, temperatures, seeds, positions)
        assert got.tolist() == want.tolist()
    if rows > 4:
        assert got[1] == 0 and got[2] == vocab // 2 and got[4] == vocab // 3


def test_many_seeds_and_positions_of_one_row(device) -> None:
    """One row of logits drawn at 256 (seed, position) pairs, every temperature from near-greedy to flat: the draws
    spread over the row, each the torch one."""
    g = torch.Generator().manual_seed(11)
    logits = (torch.randn(1, 500, generator=g) * 3).expand(256, 500).contiguous().to(device)
    temperatures = torch.linspace(0.02, 4.0, 256, dtype=torch.float64).tolist()
    seeds, positions = list(range(-128, 128)), [3 * i for i in range(256)]
    got = gumbel_argmax(logits, *on_device(temperatures, seeds, positions, device), config={"block_V": 128,
                                                                                           "num_warps": 4})
    assert got.tolist() == sample_plain_torch(logits, temperatures, seeds, positions).tolist()
    assert len(set(got.tolist())) > 20


def test_ties_nans_and_signed_zeros_follow_torch_argmax(device) -> None:
    """Greedy rows: -0 and +0 are equal maxima (the first wins), the first NaN beats everything, +inf ties; sampled
    rows: +inf logits tie whatever the noise, a row of -inf and NaN falls back to its first NaN."""
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor([[-1.0, -0.0, 0.0, -2.0, -0.0],
                           [1.0, nan, 2.0, nan, inf],
                           [-inf, inf, 3.0, inf, -inf],
                           [-inf, inf, 3.0, inf, -inf],
                           [-inf, -inf, nan, -inf, nan],
                           [-inf, -inf, -inf, -inf, -inf]], device=device)
    temperatures = [0.0, 0.0, 0.0, 0.7, 1.3, 0.9]
    seeds, positions = [5] * 6, list(range(6))
    got = gumbel_argmax(logits, *on_device(temperatures, seeds, positions, device), config={"block_V": 2,
                                                                                           "num_warps": 1})
    assert got.tolist() == sample_plain_torch(logits, temperatures, seeds, positions).tolist() == [1, 1, 1, 1, 2, 0]


def test_a_row_is_the_same_alone_among_others_and_in_any_block(device) -> None:
    logits, temperatures, seeds, positions = draw_args(24, 700, device, seed=4)
    args = on_device(temperatures, seeds, positions, device)
    every = gumbel_argmax(logits, *args, config={"block_V": 128, "num_warps": 4})
    for block_V in (16, 256, 1024):  # the token is an exact argmax: the blocks do not change it
        assert torch.equal(gumbel_argmax(logits, *args, config={"block_V": block_V, "num_warps": 4}), every)
    for r in (0, 4, 13, 23):
        alone = gumbel_argmax(logits[r:r + 1], *(a[r:r + 1] for a in args), config={"block_V": 128, "num_warps": 4})
        assert alone[0] == every[r]
    strided = torch.full((24, 800), 99.0, device=device)[:, :700]  # rows strided, the tokens past 700 never read
    strided.copy_(logits)
    assert torch.equal(gumbel_argmax(strided, *args, config={"block_V": 128, "num_warps": 4}), every)


def test_bad_arguments_name_the_argument(device) -> None:
    logits, temperatures, seeds, positions = draw_args(4, 64, device)
    factors, s, p = on_device(temperatures, seeds, positions, device)
    with pytest.raises(ValueError, match="logits"):
        gumbel_argmax(logits[0], factors, s, p)
    with pytest.raises(ValueError, match="logits"):
        gumbel_argmax(logits.half(), factors, s, p)
    with pytest.raises(ValueError, match="logits"):
        gumbel_argmax(logits[:, :0], factors, s, p)
    with pytest.raises(ValueError, match="factors"):
        gumbel_argmax(logits, factors.float(), s, p)
    with pytest.raises(ValueError, match="seeds"):
        gumbel_argmax(logits, factors, s.int(), p)
    with pytest.raises(ValueError, match="positions"):
        gumbel_argmax(logits, factors, s, p[:3])
    assert gumbel_argmax(logits[:0], factors[:0], s[:0], p[:0]).shape == (0,)


def test_the_sm90_model_lends_its_launcher_to_sampling_once_it_has_one() -> None:
    """`CompiledModel.sampling()` on a GPU target routes launches to the artifact's launcher (`sample_plain` then
    launches the sampling kernel's cubins, which every GPU artifact holds, no Triton needed); before the first step
    made one, launches stay on the JIT."""
    from dsl.graph import Graph
    from graphs.aot import record_sampling_launches
    from graphs.compiled_model import CompiledModel
    from graphs.plan import Plan
    from graphs.plan_runtime import PlanRuntime

    keys = record_sampling_launches(VOCAB)
    assert {k.split("(")[0] for k in keys} == set(KERNEL_NAMES) and len(keys) == 2
    assert all("V=129280" in k or "BLOCKS=127" in k for k in keys)
    runtime = PlanRuntime(Graph(), Plan("sm90", []), {}, {}, {})
    model = CompiledModel(None, Graph(), "sm90", runtime)
    for launcher in (None, lambda call: None):  # before a step; after it made the cubins' launcher
        runtime.launcher = launcher
        with model.sampling():
            assert is_jit() == (launcher is None)
        assert is_jit()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 64, 256])
def test_v41_vocabulary_on_the_gpu(rows) -> None:
    """V4.1's 129280 tokens: `sample_plain` on the kernel picks the torch float64 path's tokens bitwise (fp32 and
    bf16 logits, greedy rows among sampled), each row the same alone; the noise is torch's bit for bit."""
    for dtype in (torch.float32, torch.bfloat16):
        logits, temperatures, seeds, positions = draw_args(rows, VOCAB, "cuda", seed=rows, dtype=dtype)
        got = sample_plain(logits, temperatures, seeds, positions)
        assert got.tolist() == sample_plain_torch(logits, temperatures, seeds, positions).tolist()
        r = rows // 2
        assert sample_plain(logits[r:r + 1], temperatures[r:r + 1], seeds[r:r + 1], positions[r:r + 1])[0] == got[r]
    s = torch.tensor([_int64(x) for x in seeds[:4]], device="cuda")
    p = torch.tensor(positions[:4], device="cuda")
    assert torch.equal(kernel_noise(s, p, VOCAB)[1], gumbel_noise(s, p, VOCAB))


@pytest.mark.gpu
def test_cubins_built_ahead_of_time_draw_the_same_tokens(tmp_path, monkeypatch) -> None:
    """The sampling kernel as an artifact holds it: built for sm90 by graphs.aot and launched through the CUDA driver
    (graphs/launcher.py), the same tokens as the torch path at V4.1's vocabulary."""
    from graphs.aot import build, record_sampling_launches
    from graphs.launcher import CubinLauncher

    monkeypatch.setenv("DEEPINFER_CACHE", str(tmp_path))
    built = build(record_sampling_launches(VOCAB), "sm90")
    launcher = CubinLauncher({k: b.spec for k, b in built.items()}, {k: b.cubin for k, b in built.items()})
    logits, temperatures, seeds, positions = draw_args(33, VOCAB, "cuda", seed=5)
    with use_launcher(launcher):
        got = sample_plain(logits, temperatures, seeds, positions)
    assert launcher.launches == 2
    assert got.tolist() == sample_plain_torch(logits, temperatures, seeds, positions).tolist()
