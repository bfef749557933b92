"""In-place decode attention (kernels/attention/paged_attention.py) against the DSL reference in float64 and against
the gathered path (the window gathered from its fp8 ring, the picks from the paged fp4 pool, the sparse attention
kernel), within explicit tolerances: the two kernels sum in different orders. Bitwise: a token alone and in a batch,
and each chunk of a mixed step on its own path."""

from __future__ import annotations

import pytest
import torch

import kernels.attention.paged_ops as paged
from dsl.cache import CacheSpec, PagedCache
from dsl.cache_format import EntryFormat
from dsl.context import ForwardContext, SequenceState
from dsl.ops.attention import kv_window_append, kv_window_block
from dsl.ops.attention import sparse_attention as ref_sparse_attention
from dsl.ops.cache_view import CacheView, PagedEntries
from dsl.ops.rounding import fp4_round, fp8_round
from dsl.transfer import to_device
from kernels.attention.lowering import SPARSE_ATTENTION, HeadsStatic
from kernels.attention.paged_attention import bucket_parts, tiles
from kernels.attention.paged_ops import in_place_chunks, paged_attention_op
from kernels.attention.sparse_attention import sparse_attention_op
from kernels.lowering import PLAIN, Call
from tests.kernels.cases import HEAD_DIM, HEADS, INDEX_TOPK, WINDOW, gen, rel_l2

WINDOW_FMT, POOL_FMT = EntryFormat("fp8", 32), EntryFormat("fp4", 16, True)  # V41_SPEC.md's window and KV entries


def make_step(chunks: list[tuple[int, int, int]], *, heads: int, dim: int, window: int, topk: int, spare: int,
              block_size: int, ratio: int = 1, device: str = "cpu", seed: int = 0) -> dict:
    """A step over sequences (start position, chunk length, compressed entries held) in real pools: each ring
    holds the positions before its chunk, each pool its entries under a shuffled block table. Returns the step's
    context, the window view as today's path gathers it before the store (`eager`), the view `kv_window_append`
    hands attention (`view`, after its store), the compressed view, picks, q and sink."""
    spec = CacheSpec(windows=((0, dim, window, WINDOW_FMT),), compressed=(("kv", 0, dim, ratio, POOL_FMT),),
                     spare=spare)
    per = block_size // ratio
    needs = [max(1, -(-held // per)) for _, _, held in chunks]
    cache = PagedCache(spec, num_slots=len(chunks) + 2, num_blocks=sum(needs) + 3, block_size=block_size,
                       device=device)
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(sum(needs) + 3, generator=g).tolist()
    ring = window + spare
    states = []
    for i, (start, _, held) in enumerate(chunks):
        table, blocks = blocks[: needs[i]], blocks[needs[i]:]
        state = SequenceState(num_tokens=start, cache=cache, slot=len(chunks) - i, block_table=table)
        past = torch.arange(max(0, start - ring), start, device=device)
        if past.numel():
            values = fp8_round(gen(past.numel(), dim, device=device, seed=seed + 7 * i), block=32)
            cache.write_window_rows(0, torch.full_like(past, state.slot), past, values)
        if held:
            entries = fp4_round(gen(held, dim, device=device, seed=seed + 7 * i + 1), block=16, e4m3_scale=True)
            cache.write_entries(state, "kv", 0, 0, entries)
        states.append(state)
    ctx = ForwardContext(states, [n for _, n, _ in chunks], device=device)
    n = ctx.num_tokens
    kv = fp8_round(gen(n, dim, device=device, seed=seed + 50), block=32)
    eager = kv_window_block(kv, layer=0, window=window, ctx=ctx)  # the view before the store, nothing stored
    eager.flat()  # gathered now
    view = kv_window_append(kv, layer=0, window=window, ctx=ctx)
    held = [h for _, _, h in chunks]
    compressed = CacheView(lengths=held, length=to_device(held, device),
                           paged=PagedEntries(cache, "kv", 0, ctx.paged.tables, ctx))
    picks = torch.full((n, topk), -1, dtype=torch.long)
    for c, h in zip(ctx.chunks, held, strict=True):
        for t in range(c.start, c.start + c.length):
            chosen = torch.randperm(h, generator=g)[:topk] if h else torch.zeros(0, dtype=torch.long)
            picks[t, : chosen.numel()] = chosen
    picks[torch.rand(n, topk, generator=g) < 0.25] = -1  # some picks name nothing
    q = gen(n, heads, dim, device=device, seed=seed + 51)
    sink = gen(heads, device=device, seed=seed + 52)
    return dict(ctx=ctx, eager=eager, view=view, compressed=compressed, topk=picks.to(device), q=q, sink=sink)


def reference(step: dict, window: int, dot_fp32: bool) -> torch.Tensor:
    """The DSL op in float64 over the step's views: the kernel's operands exactly (bf16 q unless `dot_fp32`; the
    decoded entries are bf16 values already)."""
    q = step["q"] if dot_fp32 else step["q"].bfloat16()
    return ref_sparse_attention(q.double(), step["eager"], step["sink"].double(), step["compressed"], step["topk"],
                                window_size=window, scale=q.shape[-1] ** -0.5, ctx=step["ctx"])


# Explicit tolerances against the float64 reference: bf16 products round the probabilities (2^-9 relative), fp32
# ones only the sums.
TOLERANCE = {False: 4e-3, True: 1e-5}


def check(step: dict, window: int, config: dict | None, dot_fp32: bool) -> torch.Tensor:
    """The in-place kernel against the float64 reference and against the gathered path (both within the tolerance:
    the two kernels sum in different orders); returns its output."""
    ctx, q, sink, comp, topk = step["ctx"], step["q"], step["sink"], step["compressed"], step["topk"]
    scale = q.shape[-1] ** -0.5
    assert all(in_place_chunks(step["view"], comp, topk, causal=True))
    got = paged_attention_op(q, step["view"], sink, comp, topk, window_size=window, scale=scale, ctx=ctx,
                             config=config, dot_fp32=dot_fp32)
    gathered = sparse_attention_op(q, step["eager"], sink, comp, topk, window_size=window, scale=scale, ctx=ctx,
                                   config=config, dot_fp32=dot_fp32)
    want = reference(step, window, dot_fp32)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_l2(got, want) < TOLERANCE[dot_fp32]
    assert rel_l2(gathered, want) < TOLERANCE[dot_fp32]
    return got


def tiles_of(block_s: int, split: int, dot_fp32: bool, device: str, heads: int = 4, dim: int = 64) -> dict:
    """The kernel's tiles with blocks of `block_s` entries: blocks under 16 entries (several window and pick blocks in
    these small caches) run under the interpreter only, since the GPU's dot takes at least 16 along K."""
    if device == "cuda" and block_s < 16:
        pytest.skip("the GPU's dot takes blocks of 16 entries or more")
    return dict(tiles(None, 1, heads, dim, dot_fp32), block_S=block_s, split=split)


STEPS = {
    "first token": [(0, 1, 0)],
    "second token": [(1, 1, 1)],
    "window edges": [(6, 1, 3), (7, 1, 7), (8, 1, 8), (9, 1, 9)],  # window 8: pos < window - 1, = window - 1, ...
    "block edges": [(20, 1, 4), (21, 1, 5), (22, 1, 3), (23, 1, 8), (24, 1, 12)],  # 4 entries a block
    "mixed decode": [(37, 1, 30), (2, 1, 1), (0, 1, 0), (13, 1, 11)],
    "verification": [(30, 4, 25), (5, 3, 4), (9, 4, 0), (7, 2, 7)],  # 1 + drafts tokens, up to spare + 1
}


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("dot_fp32", [False, True])
@pytest.mark.parametrize("block_s,split", [(16, 1), (4, 1), (4, 3), (2, 16)],
                         ids=["whole", "narrow", "three parts", "parts past the blocks"])
def test_paged_attention_matches_the_reference(name, dot_fp32, block_s, split, device) -> None:
    step = make_step(STEPS[name], heads=4, dim=64, window=8, topk=6, spare=3, block_size=4, device=device)
    check(step, 8, tiles_of(block_s, split, dot_fp32, device), dot_fp32)


def test_paged_attention_over_pairs_and_without_picks(device) -> None:
    """Ratio-2 pools (2 entries a block of 4 positions), a plan's config, and the window-only layers (no picks)."""
    step = make_step(STEPS["mixed decode"], heads=3, dim=64, window=8, topk=5, spare=1, block_size=4, ratio=2,
                     device=device)
    plan_config = dict(block_H=16, block_S=16, num_warps=4, num_stages=2, split_kv=2)
    check(step, 8, plan_config, False)
    step["topk"] = None
    check(step, 8, plan_config, False)


@pytest.mark.parametrize("split", [1, 3])
def test_a_token_alone_is_the_token_in_its_batch(split, device) -> None:
    """Batch invariance: each token's program reads only its own row of the index tensors and its chunk's caches,
    and the parts of its entries follow the config alone, so a token computed alone is bitwise the same token
    computed in a batch of any size."""
    config = tiles_of(16 if device == "cuda" else 4, split, False, device)
    step = make_step(STEPS["verification"] + STEPS["mixed decode"], heads=4, dim=64, window=8, topk=6, spare=3,
                     block_size=4, device=device)
    batch = check(step, 8, config, False)
    common = dict(q=step["q"], window=step["view"], sink=step["sink"], compressed=step["compressed"],
                  topk=step["topk"], window_size=8, scale=0.125, ctx=step["ctx"], config=config)
    for rows in ([0], [5, 2], [12, 3, 9, 0, 7]):
        alone = paged_attention_op(**common, rows=torch.tensor(rows, device=device))
        assert torch.equal(alone, batch[rows])


def test_mixed_steps_take_each_chunk_s_own_path(monkeypatch, device) -> None:
    """A forward with a prefill chunk (longer than the ring's spare positions + 1) and decode chunks: with the
    in-place kernel on, the decode chunks' rows are the in-place kernel's over the ring, computed alone, and the
    prefill's the in-place kernel's over the view's snapshot, bitwise; neither follows the other chunks."""
    step = make_step([(10, 5, 4), (3, 1, 2), (20, 2, 9)], heads=2, dim=64, window=8, topk=4, spare=3, block_size=4,
                     device=device)
    view, comp, topk, ctx = step["view"], step["compressed"], step["topk"], step["ctx"]
    assert in_place_chunks(view, comp, topk, causal=True) == [False, True, True]
    assert torch.equal(view.flat(), step["eager"].flat())  # the view was gathered before the store
    monkeypatch.setattr(paged, "IN_PLACE", True)
    config = SPARSE_ATTENTION.invariant(SPARSE_ATTENTION.default_config(HeadsStatic(2, 64), 8))
    attrs = dict(window_size=8, scale=0.125, causal=True)
    call = Call(HeadsStatic(2, 64), PLAIN, config, attrs, args=(step["q"], view, step["sink"], comp, topk), ctx=ctx)
    got = SPARSE_ATTENTION.run(call)
    common = dict(window_size=8, scale=0.125, ctx=ctx, config=config)
    near, far = torch.tensor([5, 6, 7], device=device), torch.tensor([0, 1, 2, 3, 4], device=device)
    assert torch.equal(got[near], paged_attention_op(step["q"], view, step["sink"], comp, topk, rows=near, **common))
    snapshot = paged_attention_op(step["q"], view, step["sink"], comp, topk, rows=far, snapshot=True, **common)
    assert torch.equal(got[far], snapshot)
    assert rel_l2(got, reference(step, 8, False)) < TOLERANCE[False]


@pytest.mark.parametrize("dot_fp32", [False, True])
def test_a_tokens_attention_does_not_follow_how_its_prompt_was_chunked(dot_fp32: bool, device) -> None:
    """A sequence's tokens through `kv_window_append` and the lowering, its prompt in one chunk past the rings'
    spare positions (read in place from its snapshot), in chunks of mixed lengths, or in chunks the ring holds (read
    from the ring): the same attention, bit for bit (batch-invariant configs); and the float64 reference's within the
    tolerance."""
    dim, heads, window, spare, n = 64, 2, 8, 3, 21
    spec = CacheSpec(windows=((0, dim, window, WINDOW_FMT),), compressed=(), spare=spare)
    kv = fp8_round(gen(n, dim, device=device, seed=3), block=32)
    q, sink = gen(n, heads, dim, device=device, seed=4), gen(heads, device=device, seed=5)
    config = SPARSE_ATTENTION.invariant(SPARSE_ATTENTION.default_config(HeadsStatic(heads, dim), 8))
    attrs = dict(window_size=window, scale=0.125, causal=True)

    def run(chunks: list[int]) -> torch.Tensor:
        cache = PagedCache(spec, num_slots=2, num_blocks=4, block_size=8, device=device)
        state, outs, at = SequenceState(cache=cache, slot=1, block_table=[0, 1, 2]), [], 0
        for length in chunks:
            ctx = ForwardContext([state], [length], device=device)
            view = kv_window_append(kv[at: at + length], layer=0, window=window, ctx=ctx)
            call = Call(HeadsStatic(heads, dim), PLAIN, config, attrs, args=(q[at: at + length], view, sink),
                        ctx=ctx, dot_fp32=dot_fp32)
            outs.append(SPARSE_ATTENTION.run(call))
            ctx.commit()
            at += length
        return torch.cat(outs)

    whole = run([n])
    assert torch.equal(run([9, 4, 1, 7]), whole) and torch.equal(run([4, 4, 4, 4, 4, 1]), whole)
    ctx = ForwardContext([SequenceState()], [n], device=device)
    eager = kv_window_block(kv, layer=0, window=window, ctx=ctx)  # no cache: the chunk's own keys
    ref_q = q if dot_fp32 else q.bfloat16()
    want = ref_sparse_attention(ref_q.double(), eager, sink.double(), window_size=window, scale=0.125, ctx=ctx)
    assert rel_l2(whole, want) < TOLERANCE[dot_fp32]


def test_long_chunks_read_a_snapshot_of_their_view(device) -> None:
    """A chunk longer than the ring's spare positions + 1 overwrites rows its view shows: the view is gathered
    before the store, the ring's in-place read declines it, and its snapshot holds it in the ring's format."""
    step = make_step([(10, 5, 4), (3, 1, 2)], heads=2, dim=64, window=8, topk=4, spare=3, block_size=4,
                     device=device)
    view = step["view"]
    assert view.ring is not None
    chunks = in_place_chunks(view, step["compressed"], step["topk"], causal=True)
    assert chunks == [False, True] and paged.snapshot_serves(view, chunks)
    assert torch.equal(view.flat(), step["eager"].flat())
    snap = view.snapshot  # chunk 0's view, positions 3 .. 14, at row p % 12 of its slot 0
    seen = view.snapshot.fmt.decode(*[p[0, torch.arange(3, 15, device=device) % 12] for p in snap.parts])
    assert snap.slots.tolist() == [0, 0] and torch.equal(seen, view.keys[0])
    assert not any(in_place_chunks(step["eager"], step["compressed"], step["topk"], causal=True))  # a draft block's


def test_a_bucket_s_parts_fill_one_wave_at_its_top() -> None:
    """The in-place kernel's parts a bucket runs (`bucket_parts`): at V4.1's 64 heads the 16-token bucket takes 8
    (128 programs at its top), the 64-token one 2, larger ones 1; the plan's configs carry them, tuned or not, and the
    batch-invariant one takes 1 (a token's entries whole)."""
    assert [bucket_parts(t, 64) for t in (1, 16, 64, 512, 8192)] == [16, 8, 2, 1, 1]
    assert bucket_parts(16, 128) == 4 and bucket_parts(64, 64, num_sms=264) == 4
    static = HeadsStatic(64, 512)
    for tokens, parts in ((16, 8), (64, 2), (512, 1)):
        config = SPARSE_ATTENTION.default_config(static, tokens)
        assert config["parts"] == parts and tiles(config, 1, 64, 512, False)["split"] == parts
        tuned = {k: v for k, v in config.items() if k != "parts"}  # the tuned configs hold the gathered kernel's
        assert SPARSE_ATTENTION.complete(tuned, static, tokens)["parts"] == parts
        assert SPARSE_ATTENTION.invariant(config)["parts"] == 1
    assert tiles({"split_kv": 4}, 1, 64, 512, False)["split"] == 4  # a plan made before parts: the split it had


def test_bad_pool_names_itself(device) -> None:
    step = make_step([(3, 1, 2)], heads=2, dim=64, window=8, topk=4, spare=1, block_size=4, device=device)
    ring = step["view"].ring
    fmt, parts = ring.cache.windows[0]
    ring.cache.windows[0] = (EntryFormat("fp8", 32, True), parts)
    with pytest.raises(ValueError, match="window"):
        paged_attention_op(step["q"], step["view"], step["sink"], window_size=8, scale=0.1, ctx=step["ctx"])
    ring.cache.windows[0] = (fmt, parts)


V41_STEPS = {
    "decode": [(1000 + 37 * i, 1, 1000 + 37 * i) for i in range(64)],  # the decoder layers' one entry a token
    "edges": [(126, 1, 63), (127, 1, 63), (128, 1, 64), (129, 1, 64), (0, 1, 0), (5000, 1, 2500)],  # window, blocks
    "verification": [(2000 + 9 * i, 4, 1000 + 4 * i) for i in range(16)],  # 3 drafts
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(V41_STEPS))
@pytest.mark.parametrize("invariant", [True, False])
def test_paged_attention_v41(name, invariant) -> None:
    """V4.1's shapes on the GPU: within the tolerance of the float64 reference, fp32 and bf16 products; a token
    alone is the token in the batch, bitwise."""
    step = make_step(V41_STEPS[name], heads=HEADS, dim=HEAD_DIM, window=WINDOW, topk=INDEX_TOPK, spare=3,
                     block_size=128, ratio=2, device="cuda")
    config = SPARSE_ATTENTION.default_config(HeadsStatic(HEADS, HEAD_DIM), step["ctx"].num_tokens)
    if invariant:
        config = SPARSE_ATTENTION.invariant(config)
    check(step, WINDOW, config, True)
    batch = check(step, WINDOW, config, False)
    rows = torch.tensor([0, step["ctx"].num_tokens - 1], device="cuda")
    alone = paged_attention_op(step["q"], step["view"], step["sink"], step["compressed"], step["topk"],
                               window_size=WINDOW, scale=HEAD_DIM**-0.5, ctx=step["ctx"], config=config, rows=rows)
    assert torch.equal(alone, batch[rows])
