"""The cache kernels against the torch path of `dsl.cache` (`EntryFormat.encode` / `decode` and the scatter and
gather), bit for bit: every byte of the pools after a store, and every value of a load, NaN for NaN."""

from __future__ import annotations

import pytest
import torch

import dsl.cache
from dsl.cache_format import EntryFormat
from dsl.ops.rounding import fp4_round, fp8_round
from kernels.cache import rows as kernel
from tests.kernels.cases import HEAD_DIM, gen

FP8, KV_FP4, KEY_FP4, FP32 = EntryFormat("fp8", 32), EntryFormat("fp4", 16, True), EntryFormat("fp4", 32), EntryFormat()
INDEX_DIM = 128


def on_grid(fmt: EntryFormat, x: torch.Tensor) -> torch.Tensor:
    """x [M, D] rounded as the model rounds what it stores."""
    if fmt.kind == "fp8":
        return fp8_round(x, block=fmt.block)
    if fmt.kind == "fp4":
        return fp4_round(x, block=fmt.block, e4m3_scale=fmt.e4m3_scale)
    return x


def values(fmt: EntryFormat, m: int, d: int, seed: int, grid: bool = True) -> torch.Tensor:
    """Random rows [m, d] of magnitudes 2^-40 .. 2^40 (tiny ones too: fp4 with power-of-two scales keeps subnormals;
    e4m3 scales span 2^-12 .. 2^9 only, past which `fp4_round` saturates or, on some torch versions, makes NaNs),
    with the corners: a zero row, zero and -0.0 blocks, the largest code, -0.0 amid values."""
    low, high = (-12, 9) if fmt.e4m3_scale else (-40, 40)
    x = gen(m, d, seed=seed) * torch.exp2(torch.randint(low, high, (m, 1), generator=torch.Generator().manual_seed(seed)))
    block = fmt.block or d
    if m > 1:
        x[1] = 0.0
        x[0, :block] = -0.0
        x[0, 1] = 0.0
        x[-1] *= 2.0**-120
    if m > 2:
        top = {"fp8": 448.0, "fp4": 6.0}.get(fmt.kind, 1.0)
        x[2, :block] = torch.linspace(-top, top, block) * 2.0**-3
        x[2, block - 1] = top * 2.0**-3
        x[2, 1::7] = -0.0
    return on_grid(fmt, x) if grid else x


def pools(fmt: EntryFormat, blocks: int, per: int, d: int, seed: int) -> list[torch.Tensor]:
    """Fresh pools full of random bytes (so a stray write shows)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (*p.shape, p.element_size()), generator=g, dtype=torch.uint8).view(p.dtype)
            .reshape(p.shape) for p in fmt.storage((blocks, per), d)]


def placement(m: int, blocks: int, per: int, paged: bool, seed: int, device: str) -> tuple:
    """(major, minor, tables) of m distinct pool rows: windows (slot, position) or entries (table row, index)."""
    g = torch.Generator().manual_seed(seed)
    cells = torch.randperm(blocks * per, generator=g)[:m]
    if not paged:  # position p of slot s lies at row p % per: positions past one ring turn
        slot, row = cells // per, cells % per
        minor = row + per * torch.randint(0, 3, (m,), generator=g)
        return slot.to(device), minor.to(device), None
    tables = torch.randperm(blocks, generator=g).reshape(-1, 4)  # [blocks / 4, 4]: 4 blocks per sequence
    block, row = cells // per, cells % per
    where = (tables == block[:, None, None]).nonzero()  # [m, 3]: (entry, table row, column) of each block
    return where[:, 1].to(device), (where[:, 2] * per + row).to(device), tables.to(device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def check(fmt: EntryFormat, m: int, d: int, paged: bool, device: str, seed: int = 0, grid: bool = True) -> None:
    blocks, per = 4 * (2 + m // 16), 8
    x = values(fmt, m, d, seed, grid).to(device)
    major, minor, tables = placement(m, blocks, per, paged, seed, device)
    want, got = pools(fmt, blocks, per, d, seed), pools(fmt, blocks, per, d, seed)
    dsl.cache.store_rows(fmt, want, x.cpu(), major.cpu(), minor.cpu(), None if tables is None else tables.cpu())
    got = [p.to(device) for p in got]
    kernel.store_rows(fmt, got, x, major, minor, tables)
    for a, b in zip(got, want, strict=True):
        assert same(a, b), f"{fmt} stored bytes differ"
    read = kernel.load_rows(fmt, got, major, minor, tables)
    ref = dsl.cache.load_rows(fmt, want, major.cpu(), minor.cpu(), None if tables is None else tables.cpu())
    assert read.shape == (m, d) and read.dtype == torch.float32
    assert torch.equal(read.cpu().isnan(), ref.isnan()) and same(read.nan_to_num(), ref.nan_to_num())
    if grid:
        assert same(read, x.float())
    if device != "cpu":  # the torch path on the device stores the same bytes too
        on_device = [p.to(device) for p in pools(fmt, blocks, per, d, seed)]
        dsl.cache.store_rows(fmt, on_device, x, major, minor, tables)
        assert all(same(a, b) for a, b in zip(on_device, want, strict=True)), "torch on the device differs"


@pytest.mark.parametrize("fmt, d", [(FP8, 64), (FP8, 96), (KV_FP4, 64), (KV_FP4, 48), (KEY_FP4, 64), (FP32, 24)])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("m", [1, 5])
def test_store_and_load_match_the_torch_path(fmt, d, paged, m, device) -> None:
    check(fmt, m, d, paged, device, seed=m + d)


@pytest.mark.parametrize("fmt, d", [(FP8, 64), (KV_FP4, 48), (KEY_FP4, 64), (FP32, 24)])
@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("m, skipped", [(1, [0]), (5, [0, 3]), (6, [1, 2, 3, 4, 5]), (4, [])])
def test_rows_of_negative_major_are_not_stored(fmt, d, paged, m, skipped, device) -> None:
    """A static step's padding rows and the groups it does not complete come with major -1: neither the kernel nor the
    masked torch path stores them, and every other row lands as before (pools of random bytes show a stray write)."""
    blocks, per = 4 * (2 + m // 16), 8
    x = values(fmt, m, d, seed=m + d).to(device)
    major, minor, tables = placement(m, blocks, per, paged, m + d, device)
    kept = torch.ones(m, dtype=torch.bool)
    kept[skipped] = False
    want = pools(fmt, blocks, per, d, seed=1)
    dsl.cache.store_rows(fmt, want, x.cpu()[kept], major.cpu()[kept], minor.cpu()[kept],
                         None if tables is None else tables.cpu())
    masked_major = torch.where(kept.to(device), major, -1)
    masked = pools(fmt, blocks, per, d, seed=1)
    dsl.cache.store_rows(fmt, masked, x.cpu(), masked_major.cpu(), minor.cpu(),
                         None if tables is None else tables.cpu(), masked=True)
    got = [p.to(device) for p in pools(fmt, blocks, per, d, seed=1)]
    kernel.store_rows(fmt, got, x, masked_major, minor, tables)
    for a, b, c in zip(got, masked, want, strict=True):
        assert same(a, c) and same(b, c), f"{fmt}: a row of negative major was stored, or a kept row was not"


@pytest.mark.parametrize("fmt", [FP8, KEY_FP4])
def test_values_off_the_grid_encode_as_the_reference(fmt, device) -> None:
    """fp8 and power-of-two fp4 encode any values (rounding them); the kernel rounds as torch does."""
    check(fmt, 6, 64, True, device, seed=3, grid=False)


def test_an_e4m3_fp4_block_off_the_grid_is_refused_by_the_reference_only() -> None:
    x = values(KV_FP4, 2, 32, 0, grid=False)
    with pytest.raises(ValueError, match="fp4 grid"):
        KV_FP4.encode(x)


def store_both(fmt: EntryFormat, x: torch.Tensor, device: str) -> None:
    """x [M, D] stored by torch and by the kernel in rows 0 .. M - 1 of windows of one row: the same bytes."""
    major, minor = torch.arange(x.shape[0]), torch.zeros(x.shape[0], dtype=torch.long)
    want, got = fmt.storage((x.shape[0], 1), x.shape[1]), [p.to(device) for p in fmt.storage((x.shape[0], 1),
                                                                                            x.shape[1])]
    dsl.cache.store_rows(fmt, want, x, major, minor)
    kernel.store_rows(fmt, got, x.to(device), major.to(device), minor.to(device))
    assert all(same(a, b) for a, b in zip(got, want, strict=True))


def test_every_e4m3_code_and_scale_byte_round_trips(device) -> None:
    """Each of the 254 finite e4m3 codes as a value of its own block (scale 1), and 2^k for every exponent the
    ue8m0 scales can take: the kernel stores what torch stores and reads back the value."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[~codes.isnan()]
    rows = torch.zeros(codes.shape[0], 32)
    rows[:, 0], rows[:, 1] = codes, 448.0  # amax 448: scale 1
    tiny = torch.zeros(250, 32)
    tiny[:, 0] = torch.exp2(torch.arange(-125.0, 125.0))
    for x in (rows, tiny):
        store_both(FP8, x, device)
        major, minor = torch.arange(x.shape[0]), torch.zeros(x.shape[0], dtype=torch.long)
        parts = [p.to(device) for p in FP8.storage((x.shape[0], 1), 32)]
        kernel.store_rows(FP8, parts, x.to(device), major.to(device), minor.to(device))
        assert same(kernel.load_rows(FP8, parts, major.to(device), minor.to(device)), x)


@pytest.mark.parametrize("fmt, top", [(FP8, 448.0), (KEY_FP4, 6.0)])
def test_ties_and_their_neighbours_round_as_torch(fmt, top, device) -> None:
    """Every midpoint between neighbouring codes (ties go to the even code), the floats either side of it, both
    signs; each block's amax `top` makes its scale 1."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float() if fmt.kind == "fp8" else \
        torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    grid = grid[(grid >= 0) & ~grid.isnan()].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(top))])
    near = torch.cat([near, -near])
    per = fmt.block - 1
    near = torch.cat([near, torch.zeros(-near.shape[0] % per)]).reshape(-1, per)
    store_both(fmt, torch.cat([near, torch.full((near.shape[0], 1), top)], dim=1), device)


def test_e4m3_scaled_blocks_take_the_reference_candidate(device) -> None:
    """Blocks of e2m1 codes whose largest is each of the candidate maxima, under every e4m3 scale: several
    candidates reproduce such a block, and the kernel must keep the reference's first."""
    g = torch.Generator().manual_seed(0)
    scales = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # [126] positive, finite
    magnitudes = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = []
    for top in (6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5):
        allowed, scale = magnitudes[magnitudes <= top], scales[torch.randperm(126, generator=g)[:48]]  # [48]
        codes = allowed[torch.randint(0, allowed.shape[0], (48, 16), generator=g)]
        codes[:, torch.randint(0, 16, (1,), generator=g)] = top
        signs = torch.randint(0, 2, codes.shape, generator=g) * 2.0 - 1
        blocks.append(codes * signs * scale[:, None])
    store_both(KV_FP4, torch.cat(blocks).reshape(-1, 64), device)


def test_no_rows_and_bad_arguments(device) -> None:
    parts = [p.to(device) for p in KV_FP4.storage((2, 4), 32)]
    none = torch.zeros(0, dtype=torch.long, device=device)
    kernel.store_rows(KV_FP4, parts, torch.zeros(0, 32, device=device), none, none, none.reshape(0, 1))
    assert kernel.load_rows(KV_FP4, parts, none, none, none.reshape(0, 1)).shape == (0, 32)
    with pytest.raises(ValueError):
        kernel.store_rows(KV_FP4, parts, torch.zeros(1, 64, device=device), none[:1] + 0, none[:1] + 0)
    with pytest.raises(ValueError):
        kernel.load_rows(EntryFormat("fp8", 32, True), parts, none, none)


def test_the_pools_hooks_give_the_cache_ops_bit_for_bit(monkeypatch) -> None:
    """The batched cache ops with the kernels as the pools' writer and reader (as the sm90 target installs them)
    against sequences keeping caches of their own: `tests/test_paged_batched.py`'s schedule, outputs all equal."""
    from tests.test_paged_batched import check_same, play

    calls = []

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(dsl.cache, "store_rows", counted(kernel.store_rows))
    monkeypatch.setattr(dsl.cache, "load_rows", counted(kernel.load_rows))
    play(7, num_seqs=3, steps=3, device="cpu", check=lambda got, want, contexts, inputs: check_same(got, want))
    assert {"store_rows", "load_rows"} <= set(calls)


def test_the_sm90_model_lends_its_pools_the_kernels_for_its_steps_only() -> None:
    """The plan runtime installs the cache kernels on the pools of a step's sequences and puts the pools' own back
    after it (an error included); with `cache_kernels` off it leaves the pools alone."""
    from dsl.cache import CacheSpec, PagedCache
    from dsl.context import SequenceState
    from dsl.graph import Graph
    from graphs.aot import record_cache_launches
    from graphs.plan import Plan
    from graphs.plan_runtime import PlanRuntime

    spec = CacheSpec(windows=((0, 64, 8, FP8),), compressed=(("kv", 1, 64, 4, KV_FP4),))
    keys = record_cache_launches(spec)
    assert {k.split("(")[0] for k in keys} == set(kernel.KERNEL_NAMES) and len(keys) == 4
    cache = PagedCache(spec, num_slots=2, num_blocks=2, block_size=8)
    states = [SequenceState(cache=cache, slot=0), SequenceState(cache=cache, slot=1), SequenceState()]
    runtime = PlanRuntime(Graph(), Plan("sm90", []), {}, {}, {})
    for lent in (True, False):
        runtime.cache_kernels = lent
        with pytest.raises(RuntimeError), runtime.pools(states):
            assert (cache.writer is kernel.store_rows) == lent and (cache.reader is kernel.load_rows) == lent
            raise RuntimeError
        assert cache.writer is dsl.cache.store_rows and cache.reader is dsl.cache.load_rows


@pytest.mark.gpu
def test_the_sm90_model_in_pools_gives_the_torch_paths_logits() -> None:
    """The trained checkpoint (fp8 windows, both fp4 caches) on the sm90 target, its sequences in pools: prefill
    chunks and decodes give the same logits bit for bit with the cache kernels and with the torch path."""
    import deepinfer
    from deepinfer.default_model import TRAINED_CHECKPOINT
    from deepinfer.models import DeepseekV41Flash
    from dsl.cache import CacheSpec, PagedCache
    from dsl.context import SequenceState

    compiled = deepinfer.compile(DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT), target="sm90")
    assert compiled.runtime.cache_kernels
    logits = {}
    for on in (True, False):
        compiled.runtime.cache_kernels = on
        cache = PagedCache(CacheSpec.from_graph(compiled.graph), 4, 40, 16, "cuda")
        seqs = [SequenceState(cache=cache, slot=i, block_table=list(range(39 - i, -1, -4))) for i in range(4)]
        gen = torch.Generator().manual_seed(0)
        logits[on] = [compiled.step([(s, torch.randint(4, 500, (n,), generator=gen).tolist()) for s in seqs],
                                    all_logits=True) for n in (7, 1, 1, 3, 1, 1, 19, 1)]
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False], strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt, d", [(FP8, HEAD_DIM), (KV_FP4, HEAD_DIM), (KEY_FP4, INDEX_DIM)])
@pytest.mark.parametrize("m", [1, 7, 64, 4097])
def test_v41_cache_shapes(fmt, d, m) -> None:
    for paged in (False, True):
        check(fmt, m, d, paged, "cuda", seed=m)
    if fmt is not KV_FP4:
        check(fmt, m, d, True, "cuda", seed=m + 1, grid=False)
