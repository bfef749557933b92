"""The rounding kernels (kernels/rounding/rounding.py) against `dsl.ops.rounding`, bit for bit: every output's bits
(-0.0 apart from 0.0), NaN positions equal. Inputs: random rows at scales 1e-6 .. 1e4, every grid value and every
midpoint (tie) at several scales with its neighbours one ulp away, blocks whose amax sits on or one ulp off a scale
boundary (powers of two, e4m3 values and the midpoints between them, the clamps), zeros and -0.0, subnormals, NaN and
inf; fp32 and bf16; 1, 3 and 17 rows, and rank 3."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.rounding import FP4_GRID, FP4_MAX, FP8_MAX
from dsl.ops.rounding import fp4_round as ref_fp4_round
from dsl.ops.rounding import fp8_round as ref_fp8_round
from kernels.rounding.rounding import fp4_round, fp8_round
from tests.conftest import fixture_dir
from tests.kernels.cases import HEAD_DIM, gen

# (op, block, e4m3_scale): the model's three kinds (fp8 windows; fp4 indexer keys and queries; fp4 compressed KV)
KINDS = [("fp8", 32, None), ("fp4", 32, False), ("fp4", 16, True)]
INF, NAN = float("inf"), float("nan")


def kernel(kind: str, block: int, e4m3_scale: bool | None):
    if kind == "fp8":
        return lambda x: fp8_round(x, block=block), lambda x: ref_fp8_round(x, block=block)
    return (lambda x: fp4_round(x, block=block, e4m3_scale=e4m3_scale),
            lambda x: ref_fp4_round(x, block=block, e4m3_scale=e4m3_scale))


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    got, want = got.cpu(), want.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN positions differ"
    ints = torch.int32 if want.dtype == torch.float32 else torch.int16
    bad = (got.view(ints) != want.view(ints)) & ~nan
    assert not bad.any(), f"{int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}: " \
                          f"{got[bad][:4].tolist()} != {want[bad][:4].tolist()}"


def e4m3_values() -> torch.Tensor:
    """Every finite non-negative e4m3 value, ascending."""
    v = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v.sort().values


def with_neighbours(v: torch.Tensor) -> torch.Tensor:
    """v, and one ulp below and above each, both signs."""
    v = torch.cat([v, torch.nextafter(v, torch.full_like(v, -INF)), torch.nextafter(v, torch.full_like(v, INF))])
    return torch.cat([v, -v])


def grid_points(kind: str) -> torch.Tensor:
    """Every grid value and every midpoint between neighbours (the ties), one ulp off each, both signs; the
    magnitudes up to the format's max."""
    grid = e4m3_values() if kind == "fp8" else torch.tensor(FP4_GRID)
    return with_neighbours(torch.cat([grid, (grid[1:] + grid[:-1]) / 2]))


def blocks_of(points: torch.Tensor, block: int, top: torch.Tensor) -> list[torch.Tensor]:
    """`points` in blocks of `block`, each block led by `top` (which sets its amax, so its scale) and its negation."""
    per = block - 2
    points = torch.cat([points, points[: -len(points) % per]]) if len(points) % per else points
    return [torch.cat([top.reshape(1), -top.reshape(1), chunk]) for chunk in points.split(per)]


def grid_blocks(kind: str, block: int, e4m3_scale: bool | None) -> list[torch.Tensor]:
    """Grid values and ties under known scales: blocks whose amax is the format's max times a scale (2^k, or for the
    e4m3 scale every e4m3 value from 2^-9) holding every grid point times that scale."""
    points, top = grid_points(kind), FP8_MAX if kind == "fp8" else FP4_MAX
    scales = e4m3_values()[1::3] if e4m3_scale else torch.exp2(torch.arange(-30.0, 31.0, 5.0))
    return [b for s in scales for b in blocks_of(points * s, block, torch.tensor(top) * s)]


def boundary_amaxes(kind: str, e4m3_scale: bool | None) -> torch.Tensor:
    """Magnitudes where the block scale steps, one ulp off each: powers of two, the format's max times them, and for
    the e4m3 scale 6 times every e4m3 value and every midpoint between them (the scale's ties), the clamp floors,
    448 * 6 and the saturation (amax / 6 past 464, at 2784)."""
    p2 = torch.exp2(torch.arange(-40.0, 41.0))
    qmax = FP8_MAX if kind == "fp8" else FP4_MAX
    v = [p2, qmax * p2, torch.tensor([1e-4, FP4_MAX * 2.0**-9, FP4_MAX * 2.0**-126, 2784.0, 2688.0, 3e4, 3e38])]
    if e4m3_scale:
        e = e4m3_values()
        v += [FP4_MAX * e, FP4_MAX * (e[1:] + e[:-1]) / 2]
    v = torch.cat(v)
    return torch.cat([v, torch.nextafter(v, torch.zeros_like(v)), torch.nextafter(v, torch.full_like(v, INF))])


def boundary_blocks(kind: str, block: int, e4m3_scale: bool | None) -> list[torch.Tensor]:
    """A block per boundary amax: random values under it, the amax (either sign) at a random place."""
    out = []
    for i, a in enumerate(boundary_amaxes(kind, e4m3_scale).tolist()):
        b = gen(block, seed=i).clamp(-3, 3) / 3 * a
        b[i % block] = a if i % 2 else -a
        out.append(b)
    return out


def special_blocks(block: int) -> list[torch.Tensor]:
    """Zeros, -0.0, mixed zeros, subnormals, and NaN / inf among values."""
    z = torch.zeros(block)
    rand = gen(block, seed=99)
    mixed = rand.clone()
    mixed[::3] = -0.0
    mixed[1::3] = 0.0
    out = [z, -z, mixed, rand * 1e-39, rand * 2.0**-149, rand * 1e-30]
    for special in (NAN, INF, -INF):
        b = rand.clone()
        b[block // 2] = special
        out.append(b)
    both = rand.clone()
    both[0], both[1] = INF, -INF
    out += [both, torch.full((block,), NAN), torch.full((block,), -INF)]
    return out


def rows_of(blocks: list[torch.Tensor], blocks_per_row: int) -> torch.Tensor:
    """The blocks as rows of `blocks_per_row` blocks, the last row filled up with random blocks."""
    block = blocks[0].numel()
    fill = -len(blocks) % blocks_per_row
    blocks = blocks + [gen(block, seed=1000 + i) for i in range(fill)]
    return torch.stack(blocks).reshape(-1, blocks_per_row * block)


def random_rows(rows: int, d: int, seed: int) -> torch.Tensor:
    """rows [rows, d]: fresh random values, each row at its own scale in 1e-6 .. 1e4."""
    scales = torch.logspace(-6, 4, 11)[torch.randint(0, 11, (rows, 1), generator=torch.Generator().manual_seed(seed))]
    return gen(rows, d, seed=seed) * scales


def check(kind: str, block: int, e4m3_scale: bool | None, x: torch.Tensor, device: str) -> None:
    run, ref = kernel(kind, block, e4m3_scale)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        assert_same_bits(run(xd.to(device)), ref(xd))


@pytest.mark.parametrize("kind,block,e4m3_scale", KINDS)
def test_grid_values_and_ties(kind, block, e4m3_scale, device) -> None:
    check(kind, block, e4m3_scale, rows_of(grid_blocks(kind, block, e4m3_scale), 4), device)


@pytest.mark.parametrize("kind,block,e4m3_scale", KINDS)
def test_scale_boundaries(kind, block, e4m3_scale, device) -> None:
    check(kind, block, e4m3_scale, rows_of(boundary_blocks(kind, block, e4m3_scale), 3), device)


@pytest.mark.parametrize("kind,block,e4m3_scale", KINDS)
def test_zeros_subnormals_nan_inf(kind, block, e4m3_scale, device) -> None:
    x = rows_of(special_blocks(block), 2)
    check(kind, block, e4m3_scale, x, device)
    want = kernel(kind, block, e4m3_scale)[1](x)
    assert torch.isnan(want).any() and (torch.signbit(want) & (want == 0)).any()  # the cases are there


@pytest.mark.parametrize("kind,block,e4m3_scale", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_random_rows(kind, block, e4m3_scale, rows, device) -> None:
    check(kind, block, e4m3_scale, random_rows(rows, 4 * block, seed=rows), device)
    check(kind, block, e4m3_scale, random_rows(rows, 3 * block, seed=rows + 1).reshape(rows, 3, block), device)


def test_the_e4m3_scale_saturates() -> None:
    """A block past amax 6 * 464 = 2784, or holding an inf, rounds against scale 448 and stays finite, in the reference
    (which clamps before its cast: torch versions differ there) and in the kernel."""
    x = torch.tensor([[3000.0] + [1.0] * 15, [INF] + [1.0] * 15])
    want = ref_fp4_round(x, block=16, e4m3_scale=True)
    assert_same_bits(fp4_round(x, block=16, e4m3_scale=True), want)
    assert want[0, 0] == 6 * 448 and want[1, 0] == 6 * 448


def test_wrapper_checks_and_empty(device) -> None:
    assert fp8_round(torch.empty(0, 64, device=device)).shape == (0, 64)
    assert fp4_round(torch.empty(0, 32, device=device, dtype=torch.bfloat16), block=16, e4m3_scale=True).dtype \
        == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of the block"):
        fp8_round(gen(2, 40, device=device), block=32)
    with pytest.raises(ValueError, match="float32/bfloat16"):
        fp4_round(gen(2, 32, device=device).half(), block=32, e4m3_scale=False)


@pytest.mark.parametrize("kind,block,e4m3_scale", KINDS)
def test_a_row_is_the_same_in_any_batch(kind, block, e4m3_scale, device) -> None:
    run, _ = kernel(kind, block, e4m3_scale)
    row = random_rows(1, 4 * block, seed=5).to(device)
    alone = run(row)
    for rows, at in [(5, 3), (37, 36)]:
        others = random_rows(rows, 4 * block, seed=rows).to(device)
        others[at] = row[0]
        assert torch.equal(run(others)[at].view(torch.int32), alone[0].view(torch.int32))


ROUNDING_OPS = ("fp8_round", "fp4_round")
FUSED_OPS = ("rope_fp8_round", "rope_fp4_round", "rope_entries_fp4_round", "rms_norm_rope_fp8_round",
             "rms_norm_rope_entries_fp4_round")


def planned(name: str, only: tuple[str, ...] | None, fused: bool = False):
    """(graph, plan, params) of a fixture for sm90 (heuristic configs), each rope fused with the rounding after it and
    the norm before it (`fused`: the pass pipeline) or not; `only` keeps the kernels of those ops alone (every other
    node runs its reference)."""
    from deepinfer.models import DeepseekV41Flash
    from dsl.passes import infer_shapes, run_passes, verify
    from graphs.passes import make_plan

    model = DeepseekV41Flash.from_pretrained(fixture_dir(name))
    graph = run_passes(model.graph()) if fused else verify(infer_shapes(model.graph()))
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,))
    for node in plan.nodes:
        if only is not None and node.op not in only:
            node.template = None
    return graph, plan, model.params()


def test_the_plan_rounds_where_the_dim_is_a_multiple_of_the_block() -> None:
    """v41-tiny (head_dim 64, index_head_dim 32): every rounding node on a kernel, over tokens (rank 2 and the
    indexer's [N, heads, 32] queries) and over entries; fused, each rounding is the epilogue of the rope before it,
    with the same blocks and scales. v41-smooth (dims 40): no rounding kernel (the reference returns x); fused, the
    kernel rotating (and norming) without rounding."""
    graph, plan, _ = planned("v41-tiny", None)
    nodes = [n for n in plan.nodes if n.op in ROUNDING_OPS]
    assert nodes and all(n.template == n.op for n in nodes)
    types = [graph.nodes[n.index].inputs[0].type for n in nodes]
    ranks = {(t.rank, str(t.shape[0])) for t in types}
    assert ranks == {(2, "N"), (3, "N"), (2, "E")}
    assert {(n.static.block, getattr(n.static, "e4m3_scale", None)) for n in nodes} == {(32, None), (32, False),
                                                                                          (16, True)}
    graph, plan, _ = planned("v41-tiny", None, fused=True)
    assert not [n for n in plan.nodes if n.op in ROUNDING_OPS]
    fused = [n for n in plan.nodes if n.op in FUSED_OPS]
    assert len(fused) == len(nodes) and all(n.template == "rope_round" for n in fused)
    # the window's kv and the indexer's keys are normed in the same pass; the compressed KV's norm has other readers
    assert {n.op for n in fused if n.static.norm} == {"rms_norm_rope_fp8_round", "rms_norm_rope_entries_fp4_round"}
    assert all(n.static.has_w and n.formats == {1: "fp32"} for n in fused if n.static.norm)
    assert {(graph.nodes[n.index].inputs[0].type.rank, str(graph.nodes[n.index].inputs[0].type.shape[0]))
            for n in fused} == ranks
    kinds = {(n.static.block, n.static.fp8, n.static.e4m3_scale) for n in fused}
    assert kinds == {(32, True, False), (32, False, False), (16, False, True)}
    _, plan, _ = planned("v41-smooth", None)
    assert all(n.template is None for n in plan.nodes if n.op in ROUNDING_OPS)
    _, plan, _ = planned("v41-smooth", None, fused=True)
    fused = [n for n in plan.nodes if n.op in FUSED_OPS]
    assert fused and all(n.template == "rope_round" and n.static.block == 0 for n in fused)  # rotated (normed) only


def run_both(first, second) -> None:
    """Two (graph, plan, params) of one fixture through the executor: two sequences' prefill, then a decode step (the
    compressed entries reach the rounding as a `Ragged`, and the first's kernels round some); their logits bit for
    bit."""
    from dsl.context import ForwardContext, SequenceState
    from dsl.ragged import Ragged
    from graphs.executor import Executor

    executors = [Executor(graph, plan, params, "cpu") for graph, plan, params in (first, second)]
    graph, plan, _ = first
    over_entries = {n.index for n in plan.kernel_nodes() if str(graph.nodes[n.index].inputs[0].type.shape[0]) == "E"}
    ragged_rows = []

    def trace(index: int, outputs: tuple) -> None:
        if index in over_entries:
            assert isinstance(outputs[0], Ragged)
            ragged_rows.append(len(outputs[0].values))

    states = {e: [SequenceState(), SequenceState()] for e in executors}
    for chunks in ([[1, 5, 9, 2, 7, 3], [4, 8, 6, 2, 1]], [[11], [12]]):
        ids = torch.tensor([t for c in chunks for t in c])
        logits = []
        for executor in executors:
            ctx = ForwardContext(states[executor], [len(c) for c in chunks])
            logits.append(executor.run({"input_ids": ids}, ctx,
                                       trace=trace if executor is executors[0] else None)["logits"])
            ctx.commit()
        assert_same_bits(logits[0], logits[1])
    assert executors[0].kernel_calls == 2 * len(plan.kernel_nodes()) and over_entries and sum(ragged_rows) > 0


def test_executor_runs_them_on_tokens_and_ragged_entries_bitwise() -> None:
    """v41-tiny, unfused, through the executor with only the rounding kernels against the same plan with none."""
    kernels = planned("v41-tiny", ROUNDING_OPS)
    graph, none, params = planned("v41-tiny", ROUNDING_OPS)
    for node in none.nodes:
        node.template = None
    run_both(kernels, (graph, none, params))


def test_fused_rope_and_rounding_are_the_two_kernels_bitwise() -> None:
    """v41-tiny, fused, with only the norm and rope kernels (`rope_round_kernel` where a rounding follows, norming
    first where a norm comes before) against the unfused graph with only the norm, rope and rounding kernels: on tokens,
    the indexer's queries and ragged entries, the same logits."""
    ops = ("rms_norm", "rope", "rope_entries")
    fused = planned("v41-tiny", ops + FUSED_OPS, fused=True)
    kernel_ops = {n.op for n in fused[1].kernel_nodes()}
    assert kernel_ops - {"rms_norm", "rope"} == {"rope_fp4_round", "rope_entries_fp4_round", "rms_norm_rope_fp8_round",
                                                  "rms_norm_rope_entries_fp4_round"}
    run_both(fused, planned("v41-tiny", ops + ROUNDING_OPS))


@pytest.mark.gpu
@pytest.mark.parametrize("kind,block,e4m3_scale,d", [("fp8", 32, None, HEAD_DIM), ("fp4", 32, False, 128),
                                                     ("fp4", 16, True, HEAD_DIM)])
@pytest.mark.parametrize("rows", [1, 7, 64, 4097])
def test_v41_shapes(kind, block, e4m3_scale, d, rows) -> None:
    """The model's shapes: fp8 windows [N, 512] / 32, the indexer's keys and queries [E or N (x heads), 128] / 32, the
    compressed KV [E, 512] / 16; against the reference on the GPU, and the corner blocks there too."""
    run, ref = kernel(kind, block, e4m3_scale)
    for dtype in (torch.float32, torch.bfloat16):
        x = random_rows(rows, d, seed=rows).to(dtype).cuda()
        assert_same_bits(run(x), ref(x))
    x = torch.cat([rows_of(grid_blocks(kind, block, e4m3_scale), d // block),
                   rows_of(boundary_blocks(kind, block, e4m3_scale), d // block),
                   rows_of(special_blocks(block), d // block)]).cuda()
    assert_same_bits(run(x), ref(x))
