"""The cache ops on a whole batch in shared pools (`ForwardContext.paged`) against the per-chunk path they replace
(sequences keeping caches of their own), bit for bit: random batches of prefill chunks, decodes and fresh sequences,
windows that wrap, ratio-4 and ratio-128 compressed caches in fp4 and fp32, drafts taken back within `spare`."""

from __future__ import annotations

import random

import pytest
import torch

from dsl.cache import CacheSpec, PagedCache
from dsl.cache_format import EntryFormat
from dsl.context import ForwardContext, SequenceState
from dsl.ops import OPS
from dsl.ops.attention import visible_entries
from dsl.ops.rounding import fp4_round, fp8_round
from kernels.attention.sparse_attention import sparse_attention_op

WINDOW, SPARE, NGRAM, HEADS, INDEX_HEADS, TOPK = 8, 3, 4, 2, 3, 6
FP8, KV_FP4, KEY_FP4 = EntryFormat("fp8", 32), EntryFormat("fp4", 16, True), EntryFormat("fp4", 32)
# Window 0 in fp8 (dim 64) and window 1 in fp32 (dim 40); layer 2 a ratio-4 KV and index source (fp4 entries, fp4
# keys of dim 32), layer 3 a ratio-128 KV source in fp32 (dim 40).
SPEC = CacheSpec(windows=((0, 64, WINDOW, FP8), (1, 40, WINDOW, EntryFormat())),
                 compressed=(("kv", 2, 64, 4, KV_FP4), ("index", 2, 32, 4, KEY_FP4), ("kv", 3, 40, 128, EntryFormat())),
                 partials=((2, 64, 4), (3, 40, 128)), history=NGRAM - 1, spare=SPARE)
OPS_REF = {name: OPS[name].reference for name in OPS}


class Twin:
    """Each sequence twice: in the pools (scattered slots and blocks) and with caches of its own."""

    def __init__(self, num_seqs: int, rng: random.Random, device: str) -> None:
        self.block_size, self.per_seq = 128, 4
        self.cache = PagedCache(SPEC, num_seqs + 2, (num_seqs + 2) * self.per_seq, self.block_size, device)
        self.slots = rng.sample(range(num_seqs + 2), num_seqs)
        self.blocks = rng.sample(range((num_seqs + 2) * self.per_seq), num_seqs * self.per_seq)
        self.paged = [self.fresh_paged(i) for i in range(num_seqs)]
        self.plain = [SequenceState() for _ in range(num_seqs)]

    def fresh_paged(self, i: int) -> SequenceState:
        table = self.blocks[i * self.per_seq: (i + 1) * self.per_seq]
        return SequenceState(cache=self.cache, slot=self.slots[i], block_table=table)

    def restart(self, i: int) -> None:
        self.paged[i], self.plain[i] = self.fresh_paged(i), SequenceState()

    def take_back(self, i: int, count: int) -> None:
        self.paged[i].num_tokens -= count
        self.plain[i].num_tokens -= count


def next_step(rng: random.Random, twin: Twin) -> list[tuple[int, int]]:
    """(sequence, chunk length) of a random subset, in random order: decodes, short chunks and prefills up to 300
    tokens (past ratio 128 and the window), some sequences restarting at position 0, within their blocks' reach."""
    step = []
    for i in rng.sample(range(len(twin.paged)), rng.randint(1, len(twin.paged))):
        room = twin.per_seq * twin.block_size - twin.paged[i].num_tokens
        if room < 2 or rng.random() < 0.1:
            twin.restart(i)
            room = twin.per_seq * twin.block_size
        step.append((i, min(rng.choice([1, 1, 1, rng.randint(2, 5), rng.randint(20, 300)]), room - 1)))
    return step


def equal(a, b) -> bool:
    return torch.equal(a, b) and a.dtype == b.dtype


def run_ops(ctx: ForwardContext, inputs: dict, ops: dict = OPS_REF) -> dict:
    """Every cache op of a model layer stack, in graph order, on `ctx`; their outputs."""
    out = {"ngrams": ops["engram_ngrams"](inputs["ids"], inputs["token_map"], n=NGRAM, pad_id=7, ctx=ctx)}
    out["block0"] = ops["kv_window_block"](inputs["kv64"], layer=0, window=WINDOW, ctx=ctx)
    out["window0"] = ops["kv_window_append"](inputs["kv64"], layer=0, window=WINDOW, ctx=ctx)
    out["window1"] = ops["kv_window_append"](inputs["kv40"], layer=1, window=WINDOW, ctx=ctx)
    pooled = ops["compress_pool"](inputs["kv64"], inputs["gate64"], layer=2, ratio=4, ctx=ctx)
    out["pooled2"] = pooled
    entries = pooled.replace(fp4_round(pooled.values, block=16, e4m3_scale=True))
    keys = pooled.replace(fp4_round(pooled.values[:, :32] * 0.5, block=32, e4m3_scale=False))
    out["index2"] = ops["cache_append"](keys, layer=2, name="index", ctx=ctx)
    out["kv2"] = ops["cache_append"](entries, layer=2, name="kv", ctx=ctx)
    pooled3 = ops["compress_pool"](inputs["kv40"], inputs["gate40"], layer=3, ratio=128, ctx=ctx)
    out["pooled3"] = pooled3
    out["kv3"] = ops["cache_append"](pooled3, layer=3, name="kv", ctx=ctx)
    out["scores"] = ops["index_scores"](inputs["q32"], inputs["w"], out["index2"], ratio=4, ctx=ctx)
    out["topk"] = ops["topk_select"](out["scores"], topk=TOPK)
    out["attention"] = ops["sparse_attention"](inputs["q64"], out["window0"], inputs["sink"], out["kv2"], out["topk"],
                                               window_size=WINDOW, scale=0.125, ctx=ctx)
    return out


def make_inputs(n: int, gen: torch.Generator, device: str) -> dict:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    return {"ids": torch.randint(0, 50, (n,), generator=gen).to(device),
            "token_map": torch.randint(0, 20, (50,), generator=gen).to(device),
            "kv64": fp8_round(rand(n, 64), block=32), "gate64": rand(n, 64), "kv40": rand(n, 40),
            "gate40": rand(n, 40), "q32": fp4_round(rand(n, INDEX_HEADS, 32), block=32, e4m3_scale=False),
            "w": rand(n, INDEX_HEADS), "q64": rand(n, HEADS, 64), "sink": rand(HEADS)}


def check_same(got: dict, want: dict) -> None:
    assert equal(got["ngrams"], want["ngrams"])
    for name in ("block0", "window0", "window1", "index2", "kv2", "kv3"):
        assert got[name].lengths == want[name].lengths, name
        assert all(equal(a.float(), b.float()) for a, b in zip(got[name].keys, want[name].keys, strict=True)), name
    for name in ("block0", "window0", "window1"):
        assert all(torch.equal(a, b) for a, b in zip(got[name].positions, want[name].positions, strict=True))
    for name in ("pooled2", "pooled3"):
        assert equal(got[name].values, want[name].values), name
        assert (got[name].counts, got[name].first) == (want[name].counts, want[name].first)
    for name in ("scores", "topk", "attention"):
        assert equal(got[name], want[name]), name


def gathered(window, compressed, topk, ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys each token attends to, in order, and which exist: what the attention kernel reads."""
    kv, idx = visible_entries(window, compressed, topk, window_size=WINDOW, ctx=ctx, dtype=torch.float32)
    return kv[idx.clamp(min=0)] * (idx >= 0)[..., None], idx >= 0


def play(seed: int, num_seqs: int, steps: int, device: str, check, paged_ops: dict = OPS_REF) -> None:
    """Run a random schedule on both copies of every sequence (the paged one through `paged_ops`), `check(paged
    outputs, plain outputs, contexts)` after each step; now and then a chunk's last tokens are taken back (at most
    `spare`, as rejected drafts)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    twin = Twin(num_seqs, rng, device)
    for _ in range(steps):
        step = next_step(rng, twin)
        lengths = [n for _, n in step]
        inputs = make_inputs(sum(lengths), gen, device)
        contexts = [ForwardContext([states[i] for i, _ in step], lengths, device)
                    for states in (twin.paged, twin.plain)]
        assert contexts[0].paged is not None and contexts[1].paged is None
        outs = [run_ops(ctx, inputs, ops) for ctx, ops in zip(contexts, (paged_ops, OPS_REF), strict=True)]
        check(outs[0], outs[1], contexts, inputs)
        for ctx in contexts:
            ctx.commit()
        for i, n in step:
            if n > 1 and rng.random() < 0.3:
                twin.take_back(i, rng.randint(1, min(SPARE, n - 1)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_cache_ops_match_the_per_chunk_path(seed: int) -> None:
    def check(got, want, contexts, inputs):
        check_same(got, want)
        for picked in (got["topk"], torch.full_like(got["topk"], -1)):
            a = gathered(got["window0"], got["kv2"], picked, contexts[0])
            b = gathered(want["window0"], want["kv2"], picked, contexts[1])
            assert equal(a[0], b[0]) and equal(a[1], b[1])

    play(seed, num_seqs=6, steps=14, device="cpu", check=check)


def test_the_batched_compute_is_close_to_the_per_chunk_one(monkeypatch) -> None:
    """Off the CPU the indexer and the reference attention (causal, and a draft block's) compute the whole batch at
    once: equal up to rounding, with -inf where the per-chunk path has it."""
    def check(got, want, contexts, inputs):
        q, sink, ctx = inputs["q64"], inputs["sink"], contexts[0]
        wanted = [OPS_REF["sparse_attention"](q, got["block0"], sink, window_size=WINDOW + 1, scale=0.125,
                                              causal=False, ctx=ctx)]
        with monkeypatch.context() as m:
            m.setattr(ForwardContext, "compute_per_chunk", property(lambda self: False))
            scores = OPS_REF["index_scores"](inputs["q32"], inputs["w"], got["index2"], ratio=4, ctx=ctx)
            attention = OPS_REF["sparse_attention"](q, got["window0"], sink, got["kv2"], got["topk"],
                                                    window_size=WINDOW, scale=0.125, ctx=ctx)
            block = OPS_REF["sparse_attention"](q, got["block0"], sink, window_size=WINDOW + 1, scale=0.125,
                                                causal=False, ctx=ctx)
        assert torch.equal(scores.isinf(), want["scores"].isinf())
        assert torch.allclose(scores, want["scores"], rtol=1e-5, atol=1e-6)
        assert torch.allclose(attention, want["attention"], rtol=1e-5, atol=1e-6)
        assert torch.allclose(block, wanted[0], rtol=1e-5, atol=1e-6)

    play(3, num_seqs=5, steps=8, device="cpu", check=check)


def test_pooled_groups_match_when_computed_batched(monkeypatch) -> None:
    monkeypatch.setattr(ForwardContext, "compute_per_chunk", property(lambda self: False))

    def check(got, want, contexts, inputs):
        for name in ("pooled2", "pooled3"):
            assert torch.allclose(got[name].values, want[name].values, rtol=1e-6, atol=1e-6)
        assert equal(got["ngrams"], want["ngrams"])

    play(4, num_seqs=5, steps=8, device="cpu", check=check)


def test_only_a_batch_in_one_pool_with_distinct_slots_goes_batched() -> None:
    cache = PagedCache(SPEC, 3, 8, 128)
    a, b = SequenceState(cache=cache, slot=0), SequenceState(cache=cache, slot=1)
    assert ForwardContext([a, b], [1, 2]).paged is not None
    assert ForwardContext([a, SequenceState()], [1, 2]).paged is None
    assert ForwardContext([a, SequenceState(cache=cache, slot=0)], [1, 2]).paged is None
    assert ForwardContext([a, SequenceState(cache=PagedCache(SPEC, 3, 8, 128), slot=1)], [1, 2]).paged is None


def test_the_kernel_reads_the_same_keys_from_the_pools() -> None:
    """The attention kernel (Triton's interpreter here) on gathered pools gives the per-chunk views' result."""
    def check(got, want, contexts, inputs):
        q, sink = inputs["q64"], inputs["sink"]
        a, b = (sparse_attention_op(q, out["window0"], sink, out["kv2"], out["topk"], window_size=WINDOW,
                                    scale=0.125, ctx=ctx, dot_fp32=True) for out, ctx in zip((got, want), contexts))
        assert equal(a, b)

    play(5, num_seqs=3, steps=3, device="cpu", check=check)


def test_the_model_in_pools_gives_its_logits_bit_for_bit(compiled_fixture) -> None:
    """v41-tiny-engram over mixed batches (fresh sequences joining, prefill chunks, decodes, tokens taken back):
    the same logits whether the sequences keep caches in pools or of their own."""
    model = compiled_fixture("v41-tiny-engram")
    spec = CacheSpec.from_graph(model.graph, spare=SPARE)
    cache = PagedCache(spec, num_slots=5, num_blocks=40, block_size=16)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    paged = [SequenceState(cache=cache, slot=4 - i, block_table=list(range(39 - i, -1, -5))) for i in range(4)]
    plain = [model.new_sequence() for _ in range(4)]
    for step in range(8):
        chosen = rng.sample(range(4), rng.randint(1, 4)) if step else [0, 1]
        lengths = [rng.choice([1, 1, 2, 5, 19]) for _ in chosen]
        chunks = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in lengths]
        a = model.step([(paged[i], c) for i, c in zip(chosen, chunks, strict=True)], all_logits=True)
        b = model.step([(plain[i], c) for i, c in zip(chosen, chunks, strict=True)], all_logits=True)
        assert torch.equal(a, b)
        for i, n in zip(chosen, lengths, strict=True):
            if n > 1 and rng.random() < 0.5:
                back = paged[i].num_tokens - min(SPARE, n - 1)
                model.rollback(paged[i], back, SPARE)
                model.rollback(plain[i], back, SPARE)


@pytest.mark.gpu
def test_batched_ops_on_the_gpu_match_the_cpu() -> None:
    """On the GPU (compute batched) the data movement is exact, the computed outputs close to the CPU's, and the
    attention kernel on the paged views close to the reference."""
    seen: dict[str, list[dict]] = {"cuda": [], "cpu": []}

    def keep(device: str):
        def check(got, want, contexts, inputs):
            row = {"ngrams": got["ngrams"].cpu(), "scores": got["scores"].cpu()}
            row |= {name: [k.cpu() for k in got[name].keys] for name in ("window0", "window1")}
            row |= {name: got[name].values.cpu() for name in ("pooled2", "pooled3")}
            if device == "cuda":
                kernel = sparse_attention_op(inputs["q64"], got["window0"], inputs["sink"], got["kv2"], got["topk"],
                                             window_size=WINDOW, scale=0.125, ctx=contexts[0], dot_fp32=True)
                assert torch.allclose(kernel, got["attention"], rtol=1e-4, atol=1e-5)
            seen[device].append(row)
        return check

    for device in seen:
        play(6, num_seqs=6, steps=6, device=device, check=keep(device))
    for cuda, cpu in zip(seen["cuda"], seen["cpu"], strict=True):
        assert equal(cuda["ngrams"], cpu["ngrams"])
        for name in ("window0", "window1"):
            assert all(equal(a, b) for a, b in zip(cuda[name], cpu[name], strict=True)), name
        for name in ("pooled2", "pooled3"):
            assert torch.allclose(cuda[name], cpu[name], rtol=1e-5, atol=1e-5), name
        assert torch.equal(cuda["scores"].isinf(), cpu["scores"].isinf())
