"""Decode attention at V4.1-Flash's shapes: reading the caches in place (kernels/attention/paged_attention.py)
against today's gathered path (the window gathered from its fp8 ring, the picks from the paged fp4 pool, the entry
lists of `visible_entries`, then the sparse attention kernel), side by side in one process.

One decode token per sequence, B sequences at ctx positions each: 64 heads x 512, window 128 (fp8, per-32
power-of-two scales), 512 picks from a decoder layer's pool (fp4, per-16 e4m3 scales, one entry a position, 64
entries a block, scattered block tables). Each row checks that both give the same fp32 output bit for bit (`same`),
then times them with the same config: the heuristic one and its batch-invariant form (split_kv 1). `gather us` and
`in place us` are medians of plain launches (events: the gathered path's host work and launch gaps count, as in an
eager step); `graphed us` replays the in-place call from a CUDA graph, which the gathered path cannot be. GB/s
counts the cache bytes a token reads once (its window and picked entries with their scales) over the in-place time;
the index tensors every layer of a forward shares are made once, as in a forward. FlashMLA's decode reaches about
3,000 GB/s on an H800.

    python bench/bench_decode_attention.py [--batches 1,16,64,256] [--contexts 1024,16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kernels.cache.rows as cache_kernels  # noqa: E402
from autotune.tune import time_us  # noqa: E402
from dsl.cache import CacheSpec, PagedCache  # noqa: E402
from dsl.cache_format import EntryFormat  # noqa: E402
from dsl.context import ForwardContext, SequenceState  # noqa: E402
from dsl.ops.attention import CacheView, PagedEntries, kv_window_append, kv_window_block  # noqa: E402
from dsl.ops.rounding import fp8_round  # noqa: E402
from dsl.transfer import to_device  # noqa: E402
from kernels.attention.paged_attention import paged_attention_op  # noqa: E402
from kernels.attention.sparse_attention import default_config, sparse_attention_op  # noqa: E402

HEADS, DIM, WINDOW, TOPK, BLOCK = 64, 512, 128, 512, 64
WINDOW_FMT, POOL_FMT = EntryFormat("fp8", 32), EntryFormat("fp4", 16, True)


def fill(parts: list[torch.Tensor], fmt: EntryFormat) -> None:
    """Valid codes and scales at random: finite e4m3 codes (never 0x7F / 0xFF) under scales 2^-11 to 2^-6, any fp4
    pair under e4m3 scales of 1/4 to 2."""
    codes, scales = parts
    if fmt.kind == "fp8":
        byte = torch.randint(0, 0x7F, codes.shape, device=codes.device, dtype=torch.uint8)
        codes.view(torch.uint8).copy_(byte | (torch.rand(codes.shape, device=codes.device) < 0.5).to(torch.uint8) << 7)
        scales.copy_(torch.randint(116, 122, scales.shape, device=scales.device, dtype=torch.uint8))
    else:
        codes.copy_(torch.randint(0, 256, codes.shape, device=codes.device, dtype=torch.uint8))
        scales.view(torch.uint8).copy_(torch.randint(0x28, 0x40, scales.shape, device=scales.device,
                                                     dtype=torch.uint8))


def make_step(batch: int, context: int, device: str = "cuda") -> dict:
    """Pools holding `batch` sequences of `context` positions, a decode step's context, views, picks, q and sink."""
    spec = CacheSpec(windows=((0, DIM, WINDOW, WINDOW_FMT),), compressed=(("kv", 0, DIM, 1, POOL_FMT),), spare=0)
    per_seq = -(-(context + 1) // BLOCK)
    cache = PagedCache(spec, batch, batch * per_seq, BLOCK, device=device)
    cache.writer, cache.reader = cache_kernels.store_rows, cache_kernels.load_rows  # as the plan runtime's steps
    fill(cache.windows[0][1], WINDOW_FMT)
    fill(cache.compressed[("kv", 0)][2], POOL_FMT)
    blocks = torch.randperm(batch * per_seq).view(batch, per_seq).tolist()
    states = [SequenceState(num_tokens=context, cache=cache, slot=i, block_table=blocks[i]) for i in range(batch)]
    ctx = ForwardContext(states, [1] * batch, device=device)
    kv = fp8_round(torch.randn(batch, DIM, device=device), block=32)
    gathered = kv_window_block(kv, layer=0, window=WINDOW, ctx=ctx)  # today's view, gathered before the store
    in_place = kv_window_append(kv, layer=0, window=WINDOW, ctx=ctx)  # stores the step's rows, gathers nothing
    lengths = [context] * batch
    compressed = CacheView(lengths=lengths, length=to_device(lengths, device),
                           paged=PagedEntries(cache, "kv", 0, ctx.paged.tables, ctx))
    topk = torch.randint(0, context, (batch, TOPK), device=device)
    topk[torch.rand(batch, TOPK, device=device) < 0.05] = -1
    q = torch.randn(batch, HEADS, DIM, device=device).bfloat16()
    sink = torch.randn(HEADS, device=device)
    return dict(ctx=ctx, kv=kv, gathered=gathered, in_place=in_place, compressed=compressed, topk=topk, q=q, sink=sink)


def cache_bytes(batch: int) -> int:
    """Bytes of cache one decode step's attention reads: per token its window's and its picks' codes and scales."""
    return batch * (WINDOW * WINDOW_FMT.entry_bytes(DIM) + TOPK * POOL_FMT.entry_bytes(DIM))


def measure(batch: int, context: int) -> list[dict]:
    s = make_step(batch, context)
    common = dict(window_size=WINDOW, scale=DIM**-0.5, ctx=s["ctx"])
    rows = []
    for mode, config in (("heuristic", default_config(batch, HEADS, DIM)),
                         ("invariant", dict(default_config(batch, HEADS, DIM), split_kv=1))):
        def gather(config=config):  # the window gathered from its ring each call, as each layer's append does
            view = kv_window_block(s["kv"], layer=0, window=WINDOW, ctx=s["ctx"])
            return sparse_attention_op(s["q"], view, s["sink"], s["compressed"], s["topk"], config=config,
                                       **common)

        def in_place(config=config):
            return paged_attention_op(s["q"], s["in_place"], s["sink"], s["compressed"], s["topk"], config=config,
                                      **common)

        same = torch.equal(gather(), in_place())
        t_gather, t_in_place = time_us(gather, graph=False), time_us(in_place, graph=False)
        t_graphed = time_us(in_place)
        rows.append(dict(B=batch, ctx=context, mode=mode, split=config.get("split_kv", 1), same=same,
                         gather_us=t_gather, in_place_us=t_in_place, graphed_us=t_graphed,
                         gbs=cache_bytes(batch) / t_graphed / 1e3, ratio=t_gather / t_in_place))
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="1024,16384")
    args = p.parse_args()
    torch.manual_seed(0)
    print("device:", torch.cuda.get_device_name(), flush=True)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            rows += measure(batch, context)
            torch.cuda.empty_cache()
    print(f"\n{'B':>4s} {'ctx':>6s} {'config':>9s} {'split':>5s} {'same':>5s} {'gather us':>10s} {'in place us':>11s} "
          f"{'graphed us':>10s} {'GB/s':>7s} {'x gather':>8s}")
    for r in rows:
        print(f"{r['B']:4d} {r['ctx']:6d} {r['mode']:>9s} {r['split']:5d} {str(r['same']):>5s} {r['gather_us']:10.1f} "
              f"{r['in_place_us']:11.1f} {r['graphed_us']:10.1f} {r['gbs']:7.0f} {r['ratio']:8.2f}")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
