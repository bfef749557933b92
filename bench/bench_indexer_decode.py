"""The sparse indexer of a decode step at the full-width slice's shapes, kernel by kernel: the in-place scores
(kernels/indexer/index_scores.py's `paged_index_scores`), then `topk_select` and `candidate_blocks`
(kernels/indexer/topk.py) over them.

One decode token per sequence, B sequences at ctx positions each, every sequence's index keys in a paged fp4 pool
(the slice's format, shapes and attributes, read from its graph: 32 heads x 128; its two indexers, of ratios 2 and 1,
so ctx / ratio entries a sequence, 16 entries a block, scattered block tables; candidate blocks where the slice picks
them). The scores are checked first against a float64 reference over
the decoded keys (bf16 queries; relative L2 under 1e-2), then timed from CUDA-graph replays (medians) under the
plan's heuristic config and, with `--sweep`, under every config of a grid (entries a program: block_L x steps; warps;
stages), each checked bit for bit against the heuristic's scores first. GB/s counts the keys' codes and scales a step
reads once; TFLOP/s the q . k products (2 x H x D a visible entry).

    python bench/bench_indexer_decode.py [--batches 1,16,64,256] [--contexts 1024,16384] [--sweep] [--top 6]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from bench_slice import slice_config, slice_weights  # noqa: E402

from autotune.tune import time_us  # noqa: E402
from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.cache_format import EntryFormat  # noqa: E402
from dsl.passes import run_passes  # noqa: E402
from kernels.indexer.index_scores import default_config, paged_index_scores  # noqa: E402
from kernels.indexer.topk import candidate_blocks, topk_select  # noqa: E402

PER = 16  # entries a pool block (64 positions at ratio 4)
TOLERANCE = 1e-2
SWEEP = {"block_L": (32, 64, 128), "steps": (1, 4, 16), "num_warps": (4, 8), "num_stages": (1, 2)}


def slice_indexers() -> list[dict]:
    """The slice's indexers, each the attributes of its nodes: heads, dim, ratio, key format, topk, and the candidate
    blocks' block and count where its scores pick them (else None)."""
    config = slice_config()
    graph = run_passes(DeepseekV41Flash(config, slice_weights(config, "meta")).graph())
    topk = next(n for n in graph.nodes if n.op == "topk_select")
    out = []
    for scores in (n for n in graph.nodes if n.op == "index_scores"):
        _, heads, dim = scores.inputs[0].type.shape
        rounding = next(n for n in graph.nodes if n.op == "fp4_round" and n.inputs[0].type.shape[-1] == dim)
        blocks = next((n for n in graph.nodes if n.op == "candidate_blocks" and n.inputs[0] is scores.outputs[0]),
                      None)
        out.append(dict(heads=int(heads), dim=int(dim), ratio=int(scores.attrs["ratio"]),
                        fmt=EntryFormat.of_rounding("fp4_round", rounding.attrs, int(dim)),
                        topk=int(topk.attrs["topk"]), block=blocks and int(blocks.attrs["block"]),
                        topk_blocks=blocks and int(blocks.attrs["topk_blocks"])))
    return out


def make_pool(batch: int, entries: int, a: dict, device: str = "cuda") -> dict:
    """A pool of `batch` sequences of `entries` fp4 keys each (random codes under power-of-two scales near 1), the
    step's tables, lengths, rows' chunks and positions, bf16 queries and fp32 head weights."""
    fmt, dim = a["fmt"], a["dim"]
    width = -(-entries // PER)
    parts = fmt.storage((batch * width, PER), dim)
    codes, scales = (p.to(device) for p in parts)
    codes.copy_(torch.randint(0, 256, codes.shape, dtype=torch.uint8))
    if fmt.e4m3_scale:
        scales.view(torch.uint8).copy_(torch.randint(0x30, 0x40, scales.shape, dtype=torch.uint8))
    else:
        scales.copy_(torch.randint(124, 130, scales.shape, dtype=torch.uint8))
    tables = torch.randperm(batch * width, device=device).view(batch, width).int()
    context = entries * a["ratio"]
    return dict(parts=[codes, scales], tables=tables, lengths=torch.full((batch,), entries, device=device),
                chunks=torch.arange(batch, device=device), positions=torch.full((batch,), context - 1, device=device),
                q=torch.randn(batch, a["heads"], dim, device=device).bfloat16(),
                w=torch.randn(batch, a["heads"], device=device), entries=entries)


def reference(s: dict, a: dict) -> torch.Tensor:
    """float64 scores [B, entries] over the decoded keys."""
    fmt, dim, heads = a["fmt"], a["dim"], a["heads"]
    keys = fmt.decode(*s["parts"]).double()  # [blocks, PER, D]
    rows = keys[s["tables"].long()].flatten(1, 2)[:, : s["entries"]]  # [B, entries, D]
    dots = torch.einsum("bhd,bed->bhe", s["q"].double(), rows).clamp_min(0) * dim**-0.5
    return (dots * (s["w"].double() * heads**-0.5)[:, :, None]).sum(1)


def scores(s: dict, a: dict, config: dict) -> torch.Tensor:
    return paged_index_scores(s["q"], s["w"], fmt=a["fmt"], parts=s["parts"], tables=s["tables"],
                              lengths=s["lengths"], row_chunks=s["chunks"], positions=s["positions"],
                              ratio=a["ratio"], width=s["entries"], config=config)


def measure(batch: int, context: int, a: dict, sweep: bool) -> dict:
    s = make_pool(batch, context // a["ratio"], a)
    heuristic = default_config(batch, a["heads"], a["dim"])
    want = scores(s, a, heuristic)
    ref = reference(s, a)
    err = float((want.double() - ref).norm() / ref.norm())
    key_bytes = batch * s["entries"] * a["fmt"].entry_bytes(a["dim"])
    flops = 2 * batch * s["entries"] * a["heads"] * a["dim"]
    row = dict(B=batch, ctx=context, ratio=a["ratio"], entries=s["entries"], err=err, ok=err < TOLERANCE,
               key_bytes=key_bytes, flops=flops, trials=[])
    if not row["ok"]:
        return row
    row["heuristic_us"] = time_us(lambda: scores(s, a, heuristic))
    if sweep:
        for values in itertools.product(*SWEEP.values()):
            config = dict(heuristic) | dict(zip(SWEEP, values, strict=True))
            try:
                same = torch.equal(scores(s, a, config), want)
                row["trials"].append((config, time_us(lambda c=config: scores(s, a, c)) if same else None,
                                      "" if same else "other bits than the heuristic's"))
            except Exception as e:  # a config the compiler or the device refuses
                row["trials"].append((config, None, f"{type(e).__name__}: {str(e)[:60]}"))
    positions = s["positions"].long()
    row["topk_us"] = time_us(lambda: topk_select(want, topk=a["topk"]))
    if a["block"]:
        row["blocks_us"] = time_us(lambda: candidate_blocks(want, positions, ratio=a["ratio"], block=a["block"],
                                                            topk_blocks=a["topk_blocks"]))
    return row


def ranked(row: dict) -> list[tuple[dict, float, str]]:
    """The sweep's timed configs of a case, fastest first."""
    return sorted((t for t in row["trials"] if t[1] is not None), key=lambda t: t[1])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--contexts", default="1024,16384")
    p.add_argument("--sweep", action="store_true", help="time every config of the grid too")
    p.add_argument("--top", type=int, default=6, help="the fastest configs of the sweep to print a case")
    args = p.parse_args()
    torch.manual_seed(0)
    indexers = slice_indexers()
    print(f"device: {torch.cuda.get_device_name()}; {indexers}", flush=True)
    rows = []
    for context, a, batch in itertools.product(map(int, args.contexts.split(",")), indexers,
                                               map(int, args.batches.split(","))):
        rows.append(measure(batch, context, a, args.sweep))
        torch.cuda.empty_cache()
        r = rows[-1]
        print(f"B={batch} ctx={context} ratio {a['ratio']}: rel err {r['err']:.1e}", flush=True)
        for config, us, _ in ranked(r)[: args.top]:
            print(f"    {us:9.1f} us  {r['key_bytes'] / us / 1e3:7.0f} GB/s  {config}")
        for config, _, why in (t for t in r["trials"] if t[1] is None):
            print(f"    failed: {why}  {config}")
    print(f"\n{'B':>4s} {'ctx':>6s} {'ratio':>5s} {'entries':>7s} {'scores us':>9s} {'GB/s':>6s} {'TFLOP/s':>7s} "
          f"{'best us':>8s} {'x heur':>6s} {'topk us':>8s} {'blocks us':>9s}")
    for r in rows:
        if not r["ok"]:
            print(f"{r['B']:4d} {r['ctx']:6d} FAILED the check: rel err {r['err']:.2e}")
            continue
        fastest = ranked(r)
        best = fastest[0][1] if fastest else r["heuristic_us"]
        blocks = f"{r['blocks_us']:9.1f}" if "blocks_us" in r else f"{'':>9s}"
        print(f"{r['B']:4d} {r['ctx']:6d} {r['ratio']:5d} {r['entries']:7d} {r['heuristic_us']:9.1f} "
              f"{r['key_bytes'] / r['heuristic_us'] / 1e3:6.0f} {r['flops'] / r['heuristic_us'] / 1e6:7.1f} "
              f"{best:8.1f} {r['heuristic_us'] / best:6.2f} {r['topk_us']:8.1f} {blocks}")
        if fastest:
            print(f"{'':>12s} best: {fastest[0][0]}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
