"""The decode MoE's routed experts at V4.1-Flash's shapes: the kernel on raw fp4 codes against the same kernel on codes
in fragment order (kernels/moe/fragments.py, what sm90 plans run), side by side in one process on one GPU.

Per token count (1, 8, 16, 64, 256 by default) and config (the plan's heuristic for the bucket, and the unsplit
16 x 64 x 128 tiles the H200 tuner chose for the raw codes), both layouts are checked first (the same routing: the
outputs must be the same bits; at 1 token both also against the op's torch reference), then timed from CUDA-graph
replays (`autotune.tune.time_us`, medians), each twice in one order and then the other, the faster kept. Routings
rotate (4 a count) so the experts streamed differ between calls. Bytes are the codes and bf16 scales of the experts a
routing touches (the activations are < 0.1% of them); TB/s against the H200's 4.28 read-only.

    python bench/bench_moe_decode.py [--tokens 1,8,16,64,256] [--experts 384] [--out results.json]
    python bench/bench_moe_decode.py --sweep [--tokens 1,16,64] [--splits 1/1,1/2] [--stages 3]
    python bench/bench_moe_decode.py --one-token

`--one-token` times one token's unrouted path (`moe_experts` at T=1: the pairs summed inside GEMM 2) against the
routed path it replaces (the routing's two kernels, the GEMMs, `moe_sum_kernel`), on fragment-order codes under the
heuristic's tiles, after checking both give the same bits.

`--sweep` times the fragment-order kernel alone under a grid of decode tiles (`sweep_configs`: splits, block_N,
stages), each checked against the heuristic's output first, and prints them fastest first with the heuristic's place:
the evidence for `default_config`'s decode tiles on the GPU at hand.

Needs a CUDA GPU and Triton (it compiles its kernels there, a minute or so); no carried cubins.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_rows import HBM_TBS, cycler  # noqa: E402

from autotune.tune import time_us  # noqa: E402
from dsl.ops.moe import moe_experts as reference  # noqa: E402
from graphs.plan import bucket_of  # noqa: E402
from kernels.moe.experts import default_config, moe_experts, prescaled  # noqa: E402
from kernels.moe.fragments import fragment_codes  # noqa: E402

D, INTER, TOPK, LIMIT = 5120, 2304, 6, 10.0
DEVICE = "cuda"
UNSPLIT = {"block_M": 16, "block_N": 64, "block_K": 128, "num_warps": 4, "num_stages": 3, "split_k": 1}
SWEEP_SPLITS = ((1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 2), (8, 4))


def experts(e: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Random raw codes, the same in fragment order, and power-of-two scales as the bf16 factor plans give."""
    shapes = ((INTER, D), (D, INTER), (INTER, D))
    raw = [torch.randint(0, 256, (e, o, i // 2), device=DEVICE, dtype=torch.uint8) for o, i in shapes]
    scales = [torch.ldexp(torch.ones(e, o, i // 32, device=DEVICE),
                          torch.randint(-8, -4, (e, o, i // 32), device=DEVICE)) for o, i in shapes]
    return raw, [fragment_codes(w) for w in raw], scales


def configs(tokens: int) -> dict[str, dict]:
    heuristic = default_config(bucket_of(tokens))
    out = {"heuristic": heuristic, "unsplit": {"up": dict(UNSPLIT), "down": dict(UNSPLIT)}}
    return out if heuristic != out["unsplit"] else {"heuristic": heuristic}


def sweep_configs(splits: tuple = SWEEP_SPLITS, stages: tuple = (3, 4)) -> dict[str, dict]:
    """Decode tiles around the heuristic's: 16 slots x block_N x 128, a warp per 16 outputs (the tuner's rule,
    kernels/moe/space.py), split-K up/down, 3 or 4 stages."""
    out = {}
    for (up, down), block_n, stages in itertools.product(splits, (64, 128), stages):
        gemm = dict(UNSPLIT, block_N=block_n, num_warps=block_n // 16, num_stages=stages)
        out[f"{up}/{down} n{block_n} s{stages}"] = {"up": dict(gemm, split_k=up), "down": dict(gemm, split_k=down)}
    return out


def sweep(tokens: int, e: int, weights: tuple, rep_ms: float, grid: dict[str, dict] | None = None) -> list[dict]:
    """Every `sweep_configs` tile on fragment-order codes at `tokens` tokens, the heuristic's too; the outputs must
    be within 1e-3 of the heuristic's, the tuner's bound (split-K adds partials in another order, then h is
    rounded to bf16)."""
    _, frag, _ = weights
    factors, routes, x, route_weights, _, nbytes = inputs(tokens, e, weights)
    heuristic = default_config(bucket_of(tokens))
    want = moe_experts(x, route_weights, routes[0], *frag, *factors, limit=LIMIT, config=heuristic)
    candidates = {"heuristic": heuristic} | {k: c for k, c in (grid or sweep_configs()).items() if c != heuristic}
    rows = []
    for name, config in candidates.items():
        got = moe_experts(x, route_weights, routes[0], *frag, *factors, limit=LIMIT, config=config)
        err = ((got - want).norm() / want.norm()).item()
        if not err < 1e-3:
            raise AssertionError(f"T={tokens} {name}: {err:.2e} from the heuristic's output")
        nxt = cycler(routes)
        us = min(time_us(lambda nxt=nxt, config=config: moe_experts(
            x, route_weights, nxt(), *frag, *factors, limit=LIMIT, config=config), rep_ms) for _ in range(2))
        rows.append({"tokens": tokens, "config": name, "us": round(us, 1), "TB/s": round(nbytes / us / 1e6, 3)})
    rows.sort(key=lambda r: r["us"])
    base = next(r["us"] for r in rows if r["config"] == "heuristic")
    for rank, r in enumerate(rows, 1):
        r |= {"rank": rank, "vs_heuristic": round(base / r["us"], 3)}
        print(json.dumps(r), flush=True)
    return rows


def one_token(e: int, weights: tuple, rep_ms: float) -> list[dict]:
    """One token unrouted against the routed path, fragment order, the heuristic's tiles: checked bitwise on every
    routing, then timed alternately (each path twice, the faster kept)."""
    _, frag, _ = weights
    factors, routes, x, route_weights, touched, nbytes = inputs(1, e, weights)
    config = default_config(bucket_of(1))

    def routed(route: torch.Tensor) -> torch.Tensor:  # as batch-invariant configs run one token
        return moe_experts(x, route_weights, route, *frag, *factors, limit=LIMIT, config=dict(config, unrouted=False))

    def unrouted(route: torch.Tensor) -> torch.Tensor:
        return moe_experts(x, route_weights, route, *frag, *factors, limit=LIMIT, config=config)

    for route in routes:
        if not torch.equal(unrouted(route), routed(route)):
            raise AssertionError("one token unrouted differs from the routed path")
    paths = {"routed": routed, "one_token": unrouted}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for order in (list(paths), list(paths)[::-1]):
        for k in order:
            nxt = cycler(routes)
            times[k].append(time_us(lambda f=paths[k], nxt=nxt: f(nxt()), rep_ms))
    old, new = min(times["routed"]), min(times["one_token"])
    row = {"tokens": 1, "experts": round(touched, 1), "GB": round(nbytes / 1e9, 3), "routed_us": round(old, 1),
           "one_token_us": round(new, 1), "routed_TB/s": round(nbytes / old / 1e6, 3),
           "one_token_TB/s": round(nbytes / new / 1e6, 3), "speedup": round(old / new, 3)}
    print(json.dumps(row), flush=True)
    return [row]


def expert_bytes(raw: list[torch.Tensor], scales: list[torch.Tensor]) -> int:
    """Bytes one expert streams: its codes and its bf16 scale factors."""
    return sum(w[0].numel() + s[0].numel() * 2 for w, s in zip(raw, scales, strict=True))


def inputs(tokens: int, e: int, weights: tuple) -> tuple:
    """(scale factors, 4 routings, x, route weights, experts a routing touches on average, the bytes they stream) for
    `tokens` tokens, seeded by the count."""
    raw, _, scales = weights
    g = torch.Generator(device=DEVICE).manual_seed(tokens)
    routes = [torch.stack([torch.randperm(e, device=DEVICE, generator=g)[:TOPK] for _ in range(tokens)])
              for _ in range(4)]
    x = torch.randn(tokens, D, device=DEVICE, generator=g)
    route_weights = torch.rand(tokens, TOPK, device=DEVICE, generator=g)
    touched = sum(len(torch.unique(r)) for r in routes) / len(routes)
    return [prescaled(s) for s in scales], routes, x, route_weights, touched, touched * expert_bytes(raw, scales)


def run(tokens: int, e: int, weights: tuple, rep_ms: float) -> list[dict]:
    raw, frag, scales = weights
    factors, routes, x, route_weights, touched, nbytes = inputs(tokens, e, weights)
    rows = []
    for name, config in configs(tokens).items():
        layouts = {"raw": raw, "fragments": frag}
        for route in routes[:2]:  # correctness first: the same bits from both layouts
            out = {k: moe_experts(x, route_weights, route, *w, *factors, limit=LIMIT, config=config)
                   for k, w in layouts.items()}
            if not torch.equal(out["raw"], out["fragments"]):
                raise AssertionError(f"T={tokens} {name}: fragments differ from raw codes "
                                     f"(max {(out['raw'] - out['fragments']).abs().max().item():.3e})")
        if tokens == 1:
            want = reference(x.bfloat16().float(), route_weights, routes[1], *raw, *scales, limit=LIMIT)
            err = ((out["fragments"] - want).norm() / want.norm()).item()
            if not err < 5e-3:
                raise AssertionError(f"T=1 {name}: {err:.2e} from the reference")
        times: dict[str, list[float]] = {k: [] for k in layouts}
        for order in (list(layouts), list(layouts)[::-1]):
            for k in order:
                nxt = cycler(routes)
                times[k].append(time_us(lambda w=layouts[k], nxt=nxt, config=config: moe_experts(
                    x, route_weights, nxt(), *w, *factors, limit=LIMIT, config=config), rep_ms))
        old, new = min(times["raw"]), min(times["fragments"])
        split = f"{config['up']['split_k']}/{config['down']['split_k']}"
        rows.append({"tokens": tokens, "config": f"{name} (split {split})", "experts": round(touched, 1),
                     "GB": round(nbytes / 1e9, 3), "raw_us": round(old, 1), "fragments_us": round(new, 1),
                     "raw_TB/s": round(nbytes / old / 1e6, 3), "fragments_TB/s": round(nbytes / new / 1e6, 3),
                     "speedup": round(old / new, 3), "fragments_%HBM": round(100 * nbytes / new / 1e6 / HBM_TBS, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'T':>4} {'config':22} {'experts':>7} {'GB':>6} {'raw us':>9} {'frag us':>9} {'raw TB/s':>8} "
            f"{'frag TB/s':>9} {'x':>6} {'%HBM':>5}")
    lines = [head] + [f"{r['tokens']:>4} {r['config']:22} {r['experts']:>7} {r['GB']:>6.2f} {r['raw_us']:>9.1f} "
                      f"{r['fragments_us']:>9.1f} {r['raw_TB/s']:>8.2f} {r['fragments_TB/s']:>9.2f} "
                      f"{r['speedup']:>6.2f} {r['fragments_%HBM']:>5.1f}" for r in rows]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,8,16,64,256")
    p.add_argument("--experts", type=int, default=384)
    p.add_argument("--rep-ms", type=float, default=25.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--sweep", action="store_true", help="fragment order alone under a grid of decode tiles")
    p.add_argument("--one-token", action="store_true", help="one token unrouted against the routed path")
    p.add_argument("--splits", help="--sweep's up/down splits, e.g. 1/1,1/2 (default: SWEEP_SPLITS)")
    p.add_argument("--stages", default="3,4", help="--sweep's stage counts")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.manual_seed(0)
    weights = experts(args.experts)
    print(f"{torch.cuda.get_device_name()}: E={args.experts} top{TOPK} {D}<->{INTER}, "
          f"{expert_bytes(weights[0], weights[2]) / 1e6:.2f} MB an expert", flush=True)
    counts = [int(v) for v in args.tokens.split(",")]
    if args.one_token:
        rows = one_token(args.experts, weights, args.rep_ms)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    if args.sweep:
        splits = tuple(tuple(int(v) for v in pair.split("/")) for pair in args.splits.split(",")) if args.splits \
            else SWEEP_SPLITS
        grid = sweep_configs(splits, tuple(int(v) for v in args.stages.split(",")))
        rows = [row for t in counts for row in sweep(t, args.experts, weights, args.rep_ms, grid)]
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
        print(f"\nfragment order, decode tiles fastest first per token count; %HBM of {HBM_TBS} TB/s")
        for r in rows:
            print(f"{r['tokens']:>4} {r['rank']:>3} {r['config']:16} {r['us']:>9.1f} us {r['TB/s']:>6.2f} TB/s "
                  f"{100 * r['TB/s'] / HBM_TBS:>5.1f} %HBM {r['vs_heuristic']:>6.3f}x the heuristic")
        return 0
    rows = [row for t in counts for row in run(t, args.experts, weights, args.rep_ms)]
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\nraw codes (the old kernel) against fragment order (the new), side by side; %HBM of {HBM_TBS} TB/s")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
