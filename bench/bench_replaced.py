"""Benchmarks of the kernels that replaced eager torch ops between the big GEMMs (bench/bench_kernels.py runs them as
its parts `engram`, `norm_e4m3`, `swiglu`, `gate_route`, `topk` and `sampling`): each at V4.1-Flash's shapes against
the torch ops it replaced, in the same rows (bench/bench_rows.py)."""

from __future__ import annotations

import torch
from bench_rows import cycler, record

import kernels.engram.hash_rows as engram_rows
import kernels.hyper.hyper as hyper
import kernels.linear.fp8 as linear_fp8
import kernels.linear.swiglu as swiglu
import kernels.moe.experts as moe
import kernels.moe.gate as moe_gate
import kernels.moe.route as moe_route
import kernels.norm.e4m3 as norm_e4m3
import kernels.norm.rms_norm as rms_norm
from autotune.tune import time_us
from dsl.ops import engram as engram_ref
from dsl.ops import moe as moe_ref
from graphs.plan import bucket_of


def bench_engram_lookup(tokens: list[int]) -> None:
    """Engram's hash and fp8 table gather in one kernel against the two torch ops it replaces (engram_hash, then
    engram_rows), at V4.1-Flash's 4-grams, 8 heads and d 256 with layer 14's multipliers; primes above 640000 keep
    the 24 columns' offsets in a table of 15M rows (3.9 GB, so the rows come from HBM as from the real 98 GB). Each
    call hashes tokens of its own (a pool rotated past the L2), so no row is read twice."""
    from deepinfer.config import DeepseekV41Config
    from deepinfer.models.engram_layout import engram_layers

    config = DeepseekV41Config(engram_layer_ids=(14,), engram_num_embeddings=(0,), engram_vocab_size=640_000)
    c = engram_layers(config)[14]
    kw = dict(multipliers=c.multipliers, primes=c.primes, offsets=c.offsets)
    rows, n, d, cols = c.offsets[-1] + c.primes[-1][-1], 4, 256, 24
    table = torch.randint(0, 0x7F, (rows, d), device="cuda", dtype=torch.uint8).view(torch.float8_e4m3fn)  # no NaN
    scale = torch.ldexp(torch.ones(rows, d // 32, device="cuda"), torch.randint(-8, 0, (rows, d // 32), device="cuda"))
    for m in tokens:
        per_call = m * cols * (d + d // 8 + 4 * d) + m * n * 8
        calls = max(2, -(-(256 << 20) // per_call))
        pool = torch.randint(0, config.engram_compressed_vocab_size, (calls * m, n), device="cuda")
        ngrams = cycler([pool[i * m:(i + 1) * m] for i in range(calls)])
        torch.testing.assert_close(engram_rows.engram_hash_rows(pool[:m], table, scale, **kw),
                                   engram_ref.engram_rows(engram_ref.engram_hash(pool[:m], **kw), table, scale),
                                   rtol=0, atol=0)
        record("engram_hash_rows fp8", f"{m}x{cols}x{d} of {rows} rows",
               time_us(lambda: engram_rows.engram_hash_rows(ngrams(), table, scale, **kw)), nbytes=per_call,
               base="torch eager (dsl ref)",
               base_us=time_us(lambda: engram_ref.engram_rows(engram_ref.engram_hash(ngrams(), **kw), table, scale)))


def bench_norm_e4m3(tokens: list[int]) -> None:
    """The norms that write e4m3 rows (fp8-activation plans) against the norm, then `quantize_rows`, as one reader of
    the normed rows ran them before (the attention's norm has two readers, wq_a and wkv: two roundings). An e4m3
    row of d values (d a multiple of 16) is d + 16 bytes."""
    hc = 4
    for d in (5120, 1280, 512):
        for m in tokens:
            x, w = torch.randn(m, d, device="cuda"), torch.randn(d, device="cuda")
            record("rms_norm e4m3", f"{m}x{d} fp32", time_us(lambda: norm_e4m3.rms_norm_e4m3(x, w, eps=1e-20)),
                   nbytes=m * d * 4 + d * 4 + m * (d + 16), base="rms_norm + quantize_rows",
                   base_us=time_us(lambda: linear_fp8.quantize_rows(rms_norm.rms_norm(x, w, eps=1e-20))))
    d = 5120
    for m in tokens:
        h, pre = torch.randn(m, hc, d, device="cuda"), torch.rand(m, hc, device="cuda")
        w = torch.randn(d, device="cuda")
        record("hc_collapse_rms_norm e4m3", f"{m}x{hc}x{d}",
               time_us(lambda: norm_e4m3.hc_collapse_rms_norm_e4m3(h, pre, w, eps=1e-20)),
               nbytes=hc * m * d * 4 + m * (d + 16), base="collapse + norm, quantize_rows",
               base_us=time_us(lambda: linear_fp8.quantize_rows(hyper.hc_collapse_rms_norm(h, pre, w, eps=1e-20))))


def bench_swiglu(tokens: list[int]) -> None:
    """The shared expert's clamped SwiGLU (width 2304) against the torch ops it replaced."""
    inter = 2304
    for m in tokens:
        gate, up = torch.randn(m, inter, device="cuda") * 8, torch.randn(m, inter, device="cuda") * 8
        record("swiglu (shared expert)", f"{m}x{inter} limit 10", time_us(lambda: swiglu.swiglu(gate, up, limit=10.0)),
               nbytes=3 * m * inter * 4, base="torch eager (dsl ref)",
               base_us=time_us(lambda: moe_ref.clamped_swiglu(gate, up, 10.0)))


def bench_gate_route(tokens: list[int]) -> None:
    """The gate's scores and top-k after its projection, and the experts' routing layout (the block size the plan's
    heuristic gives the bucket), at 384 experts top 6 against the torch ops they replace, both captured."""
    e, topk = 384, 6
    kw = {"topk": topk, "func": "sqrtsoftplus", "temp": 1.0, "normalize": True, "scaling": 1.5}
    for m in tokens:
        logits, bias = torch.randn(m, e, device="cuda"), torch.randn(e, device="cuda") * 0.1
        ours = time_us(lambda: moe_gate.gate_topk(logits, bias, **kw))
        base = time_us(lambda: moe_ref.gate_topk(logits, bias, **kw))
        record("moe gate top-k", f"T={m} E={e} top{topk} sqrtsoftplus", ours, nbytes=m * e * 4 + e * 4 + m * topk * 12,
               base="torch eager (dsl ref)", base_us=base)
        experts = moe_gate.gate_topk(logits, bias, **kw)[1]
        block_m = moe.default_config(bucket_of(m))["up"]["block_M"]
        ours = time_us(lambda: moe_route.route(experts, e, block_m))
        base = time_us(lambda: moe_route.route_ref(experts, e, block_m))
        record("moe route", f"T={m} E={e} top{topk} block_M={block_m}", ours, base="torch (route_ref)", base_us=base)


def _topk_case(m: int, width: int, topk_blocks: int) -> tuple:
    """The indexer's selection at m tokens over `width` entries, each token seeing all of them (a context of 4 x
    width at ratio 4): (scores [m, width], the forward context, candidate_blocks' arguments (blocks of 8), the
    reference's candidates)."""
    from dsl.context import ForwardContext, SequenceState
    from dsl.ops import indexer as ref

    scores = torch.randn(m, width, device="cuda")
    ctx = ForwardContext([SequenceState(num_tokens=4 * width - 1 - i % 4) for i in range(m)], [1] * m, device="cuda")
    blocks = dict(ratio=4, block=8, topk_blocks=topk_blocks)
    return scores, ctx, blocks, ref.candidate_blocks(scores, **blocks, ctx=ctx)


def bench_topk(tokens: list[int], widths: tuple[int, ...] = (2048, 16384)) -> None:
    """The indexer's selection (kernels/indexer/topk.py) against the torch ops it replaces (dsl/ops/indexer.py), each
    token seeing all C entries: index_topk 512, alone (topk, where) and inside candidates (masked_fill first), and
    candidate blocks of 8 at ratio 4, top 2048 (amax, masked_fill, topk, scatter, gather; the block layout memoized
    as within a forward). C up to 16384 keeps every block: the kernel then skips its search."""
    import kernels.indexer.topk as topk
    from dsl.ops import indexer as ref

    for width in widths:
        for m in tokens:
            scores, ctx, blocks, candidates = _topk_case(m, width, topk_blocks=2048)
            for name, cands in (("topk_select", None), ("topk_select cand", candidates)):
                record(name, f"T={m} C={width} K=512", time_us(lambda c=cands: topk.topk_select(scores, c, topk=512)),
                       nbytes=m * (width * (4 if cands is None else 5) + 512 * 8), base="torch eager",
                       base_us=time_us(lambda c=cands: ref.topk_select(scores, c, topk=512)))
            record("candidate_blocks", f"T={m} C={width} block 8 top 2048",
                   time_us(lambda: topk.candidate_blocks(scores, ctx.positions, **blocks)), nbytes=m * width * 5,
                   base="torch eager", base_us=time_us(lambda: ref.candidate_blocks(scores, **blocks, ctx=ctx)))


TOPK_TILES = [(4096, 16), (4096, 8), (2048, 8), (2048, 4), (1024, 4), (1024, 2), (512, 2), (256, 1)]


def bench_topk_tiles(tokens: list[int], widths: tuple[int, ...] = (2048, 16384)) -> None:
    """The sweep `kernels.indexer.topk.default_config` was chosen from: each (block_N, num_warps) of `TOPK_TILES` for
    topk_select (alone and inside candidates) and candidate_blocks (its tile block_N / 8 blocks of 8; top 256, which
    selects at C 16384), against torch's ops; any tile picks the same items."""
    import kernels.indexer.topk as topk
    from dsl.ops import indexer as ref

    for width in widths:
        for m in tokens:
            scores, ctx, blocks, candidates = _topk_case(m, width, topk_blocks=256)
            base = {"topk_select": time_us(lambda: ref.topk_select(scores, None, topk=512)),
                    "topk_select cand": time_us(lambda: ref.topk_select(scores, candidates, topk=512)),
                    "candidate_blocks": time_us(lambda: ref.candidate_blocks(scores, **blocks, ctx=ctx))}
            for block_n, warps in TOPK_TILES:
                config = {"block_N": block_n, "num_warps": warps}
                runs = {"topk_select": lambda c=config: topk.topk_select(scores, None, topk=512, config=c),
                        "topk_select cand": lambda c=config: topk.topk_select(scores, candidates, topk=512, config=c),
                        "candidate_blocks": lambda c=dict(config, block_N=block_n // 8): topk.candidate_blocks(
                            scores, ctx.positions, **blocks, config=c)}
                for name, run in runs.items():
                    record(f"{name} {block_n}/{warps}w", f"T={m} C={width}", time_us(run), base="torch eager",
                           base_us=base[name])


def bench_sampling(rows: list[int], vocab: int = 129280) -> None:
    """Seeded draws over V4.1's vocabulary against `sample_plain`'s torch float64 path (deepinfer/sampler.py) as the
    engine calls it (host lists in, host time included): the kernels alone (kernels/sampling/gumbel_argmax.py,
    replayed), then `sample_plain` on them (the lists packed and copied, two launches)."""
    from deepinfer.sampler import sample_plain, sample_plain_torch
    from kernels.sampling.gumbel_argmax import gumbel_argmax

    for m in rows:
        logits = torch.randn(m, vocab, device="cuda") * 4
        temperatures = torch.empty(m).uniform_(0.3, 1.5).tolist()
        seeds, positions = list(range(m)), list(range(1000, 1000 + m))
        args = (logits, temperatures, seeds, positions)
        base_us = time_us(lambda a=args: sample_plain_torch(*a), graph=False)
        factors = torch.tensor([1.0 / t for t in temperatures], dtype=torch.float64, device="cuda")
        on_device = (logits, factors, torch.tensor(seeds, device="cuda"), torch.tensor(positions, device="cuda"))
        record("sampling kernels", f"R={m} V={vocab}", time_us(lambda a=on_device: gumbel_argmax(*a)),
               nbytes=m * vocab * 4, base="torch fp64 sample_plain", base_us=base_us)
        record("sample_plain (kernels)", f"R={m} V={vocab}", time_us(lambda a=args: sample_plain(*a), graph=False),
               base="torch fp64 sample_plain", base_us=base_us)


__all__ = ["bench_engram_lookup", "bench_gate_route", "bench_norm_e4m3", "bench_sampling", "bench_swiglu", "bench_topk",
           "bench_topk_tiles"]
