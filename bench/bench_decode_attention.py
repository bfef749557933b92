"""Decode attention at V4.1-Flash's shapes, side by side in one process: the in-place kernel
(kernels/attention/paged_attention.py) and the gathered path (the window gathered from its fp8 ring, the picks from
the paged fp4 pool, the entry lists of `visible_entries`, then the sparse attention kernel).

One decode token per sequence, B sequences at ctx positions each: 64 heads x 512, window 128 (fp8, per-32
power-of-two scales), 512 picks from a decoder layer's pool (fp4, per-16 e4m3 scales, one entry a position, 64
entries a block, scattered block tables). Every row is checked first: each path's fp32 output against the float64
reference (the DSL op over the same decoded entries, bf16 q), relative L2 under 4e-3. Then each is timed with the
plan's config for B tokens (`heuristic`) and, where it differs, its batch-invariant form (`invariant`, one part per
token): medians
of plain launches (events; the gathered path's host work and launch gaps count, as in an eager step), and the
in-place kernel replayed from a CUDA graph too (`graphed`), which the gathered path cannot be. GB/s counts the bytes
a token must move, over the graphed time: its window's and picks' codes and scales, its pick ids, q (bf16) and the
output (fp32); `of HBM` is that over the H200's 4.28 TB/s. FlashMLA's decode reaches about 3,000 GB/s on an H800.

    python bench/bench_decode_attention.py [--batches 1,16,64,256] [--contexts 1024,16384] [--splits 1,2,4,8,16]

--splits also times the in-place kernel (graphed) at each of those parts a token (`parts`), each checked first.
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
from dsl.ops.attention import kv_window_append, kv_window_block  # noqa: E402
from dsl.ops.attention import sparse_attention as reference  # noqa: E402
from dsl.ops.cache_view import CacheView, PagedEntries  # noqa: E402
from dsl.ops.rounding import fp8_round  # noqa: E402
from dsl.transfer import to_device  # noqa: E402
from kernels.attention.lowering import SPARSE_ATTENTION, HeadsStatic  # noqa: E402
from kernels.attention.paged_ops import paged_attention_op  # noqa: E402
from kernels.attention.sparse_attention import sparse_attention_op  # noqa: E402

HEADS, DIM, WINDOW, TOPK, BLOCK = 64, 512, 128, 512, 64
WINDOW_FMT, POOL_FMT = EntryFormat("fp8", 32), EntryFormat("fp4", 16, True)
HBM = 4.28e12  # bytes/s, the H200's measured read ceiling
TOLERANCE = 4e-3


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
    gathered = kv_window_block(kv, layer=0, window=WINDOW, ctx=ctx)  # the view gathered before the store
    in_place = kv_window_append(kv, layer=0, window=WINDOW, ctx=ctx)  # stores the step's rows, gathers nothing
    lengths = [context] * batch
    compressed = CacheView(lengths=lengths, length=to_device(lengths, device),
                           paged=PagedEntries(cache, "kv", 0, ctx.paged.tables, ctx))
    topk = torch.rand(batch, context, device=device).argsort(dim=1)[:, :TOPK]  # distinct picks, as the indexer's
    topk[torch.rand(batch, TOPK, device=device) < 0.05] = -1
    q = torch.randn(batch, HEADS, DIM, device=device).bfloat16()
    sink = torch.randn(HEADS, device=device)
    return dict(ctx=ctx, kv=kv, gathered=gathered, in_place=in_place, compressed=compressed, topk=topk, q=q, sink=sink)


def token_bytes() -> int:
    """Bytes one decode token moves at least: its window's and picks' codes and scales, its pick ids, q and out."""
    cache = WINDOW * WINDOW_FMT.entry_bytes(DIM) + TOPK * POOL_FMT.entry_bytes(DIM)
    return cache + TOPK * 4 + HEADS * DIM * (2 + 4)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def measure(batch: int, context: int, splits: tuple[int, ...] = ()) -> list[dict]:
    s = make_step(batch, context)
    common = dict(window_size=WINDOW, scale=DIM**-0.5, ctx=s["ctx"])
    args = (s["q"], s["in_place"], s["sink"], s["compressed"], s["topk"])
    heuristic = SPARSE_ATTENTION.default_config(HeadsStatic(HEADS, DIM), batch)
    rows = []
    invariant = SPARSE_ATTENTION.invariant(heuristic)
    modes = [("heuristic", heuristic)] + ([("invariant", invariant)] if invariant != heuristic else [])
    modes += [(f"split {n}", dict(heuristic, split_kv=n, parts=n)) for n in splits]
    for mode, config in modes:  # the heuristic's row serves both where they are the same config
        def gather(config=config):  # the window gathered from its ring each call, as each layer's append does
            view = kv_window_block(s["kv"], layer=0, window=WINDOW, ctx=s["ctx"])
            return sparse_attention_op(s["q"], view, *args[2:], config=config, **common)

        def new(config=config):
            return paged_attention_op(*args, config=config, **common)

        want = reference(s["q"].double(), s["gathered"], s["sink"].double(), s["compressed"], s["topk"], **common)
        errors = {name: rel_l2(fn(), want) for name, fn in (("new", new), ("gathered", gather))}
        row = dict(B=batch, ctx=context, mode=mode, split=config["split_kv"], parts=config["parts"], errors=errors,
                   ok=all(e < TOLERANCE for e in errors.values()))
        if row["ok"] and mode.startswith("split"):  # the in-place kernel's parts alone
            row |= dict(new_us=float("nan"), graphed_us=time_us(new), gather_us=float("nan"))
        elif row["ok"]:
            row |= dict(new_us=time_us(new, graph=False), graphed_us=time_us(new),
                        gather_us=time_us(gather, graph=False))
        if row["ok"]:
            row["gbs"] = batch * token_bytes() / row["graphed_us"] / 1e3
        rows.append(row)
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="1024,16384")
    p.add_argument("--splits", default="", help="also time the in-place kernel at these parts a token")
    args = p.parse_args()
    splits = tuple(int(n) for n in args.splits.split(",") if n)
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}; {token_bytes()} bytes a token", flush=True)
    rows = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            rows += measure(batch, context, splits)
            torch.cuda.empty_cache()
    print(f"\n{'B':>4s} {'ctx':>6s} {'config':>9s} {'split':>5s} {'parts':>5s} {'in place':>8s} {'graphed':>8s} "
          f"{'gather us':>9s} {'GB/s':>6s} {'of HBM':>6s} {'x gather':>8s} {'rel err':>8s}")
    for r in rows:  # split: the gathered kernel's parts (`split_kv`); parts: the in-place kernel's
        if not r["ok"]:
            print(f"{r['B']:4d} {r['ctx']:6d} {r['mode']:>9s} {r['split']:5d} {r['parts']:5d}  FAILED the check: "
                  f"{r['errors']}")
            continue
        print(f"{r['B']:4d} {r['ctx']:6d} {r['mode']:>9s} {r['split']:5d} {r['parts']:5d} {r['new_us']:8.1f} "
              f"{r['graphed_us']:8.1f} {r['gather_us']:9.1f} {r['gbs']:6.0f} {r['gbs'] * 1e9 / HBM:6.1%} "
              f"{r['gather_us'] / r['new_us']:8.1f} {r['errors']['new']:8.1e}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
