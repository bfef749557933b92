"""Per-kernel benchmarks at the full V4.1-Flash shapes, against torch (eager / cuBLAS / _scaled_mm) in the same run.

Times are medians of CUDA-graph replays (`autotune.tune.time_us`: no launch gaps); weights rotate through
copies larger than the L2 so each call streams from HBM, as in a model. Bytes count every input read once and
every output written once; TB/s and TFLOP/s are over the H200 ceilings measured in the same run (and DESIGN.md's).

    python bench/bench_kernels.py [--out results.json] [--tuning autotune/tuned/sm90.json] [--only tilelang,norms]

TileLang kernels run from cubins through the CUDA driver: built here when TileLang can build, else prebuilt
(`python -m tests.kernels.tilelang_cubins .prebuilt/tilelang` on any machine, carried to the GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_prefill import bench_prefill_gemm, bench_prefill_switch  # noqa: E402
from bench_replaced import (  # noqa: E402
    bench_engram_lookup,
    bench_gate_route,
    bench_norm_e4m3,
    bench_sampling,
    bench_swiglu,
    bench_topk,
    bench_topk_tiles,
)
from bench_rows import FP8_TFLOPS, LINEARS, ROWS, cycler, record  # noqa: E402

import kernels.attention.sparse_attention as attention  # noqa: E402
import kernels.engram.gate as engram  # noqa: E402
import kernels.hyper.hyper as hyper  # noqa: E402
import kernels.hyper.mixes as mixes  # noqa: E402
import kernels.indexer.index_scores as indexer  # noqa: E402
import kernels.linear.linear as linear  # noqa: E402
import kernels.moe.experts as moe  # noqa: E402
from kernels.moe.fragments import fragment_codes  # noqa: E402
import kernels.norm.rms_norm as rms_norm  # noqa: E402
import kernels.rope.rope as rope  # noqa: E402
from autotune.cache import TuningCache, cache_key, template_hash  # noqa: E402
from autotune.tune import time_us  # noqa: E402
from dsl.ops import dense as dense_ref  # noqa: E402
from dsl.ops import engram as engram_ref  # noqa: E402
from dsl.ops import hyper as hyper_ref  # noqa: E402
from dsl.ops import moe as moe_ref  # noqa: E402
from dsl.ops import rope as rope_ref  # noqa: E402
from dsl.quant import quantize_fp8_block  # noqa: E402
from graphs.plan import bucket_of  # noqa: E402
from kernels.tuning import rotation  # noqa: E402

TUNED: TuningCache | None = None  # --tuning: configs from a tuning file; else each kernel's heuristic


def tuned(template: str, static: dict, m: int) -> dict | None:
    """The tuned config of a kernel node for `m` tokens, as a compiled plan would pick it (None: heuristic)."""
    if TUNED is None:
        return None
    key = cache_key(template, static, bucket_of(m), "sm90", torch.cuda.get_device_name(), template_hash(template))
    return TUNED.get(key)


def ceilings() -> None:
    x = torch.randn(1 << 30, device="cuda")  # 4 GiB
    us = time_us(lambda: x.sum(), 50)
    record("ceiling: read (sum)", "4 GiB fp32", us, nbytes=x.numel() * 4)
    y = torch.empty_like(x)
    us = time_us(lambda: y.copy_(x), 50)
    record("ceiling: copy", "4 GiB fp32", us, nbytes=2 * x.numel() * 4)
    a, b = (torch.randn(8192, 8192, device="cuda").bfloat16() for _ in range(2))
    us = time_us(lambda: a @ b, 50)
    record("ceiling: cuBLAS bf16", "8192^3", us, flops=2 * 8192**3)


def bench_linear(tokens: list[int]) -> None:
    for name, n, k, g in LINEARS:
        w32 = torch.randn(g * n, k, device="cuda") * k**-0.5
        wb = rotation(w32.bfloat16())
        q, s = quantize_fp8_block(w32)
        wq = rotation(q)
        del w32
        for m in tokens:
            x = torch.randn(m, g * k, device="cuda")
            xb = x.bfloat16()
            shape = f"{name} {g}x{n}x{k} M={m}"
            nb = cycler(wb)
            cfg = tuned("linear", {"n": n, "k": k, "groups": g, "fmt": "plain"}, m)
            ours = time_us(lambda: linear.linear(x, nb(), groups=g, config=cfg))
            if g == 1:
                base = time_us(lambda: torch.nn.functional.linear(xb, nb()))
            else:
                xg = xb.view(m, g, k).transpose(0, 1)
                base = time_us(lambda: torch.bmm(xg, nb().view(g, n, k).transpose(1, 2)))
            wbytes = g * n * k * 2
            record("linear bf16", shape, ours, nbytes=wbytes + m * g * k * 4 + m * g * n * 4,
                   flops=2 * m * g * n * k, base="cuBLAS bf16", base_us=base)
            nq = cycler(wq)
            cfg = tuned("linear", {"n": n, "k": k, "groups": g, "fmt": "fp8"}, m)
            ours = time_us(lambda: linear.linear(x, nq(), s, groups=g, config=cfg))
            fbytes = g * n * k + s.numel() * 4
            row = dict(nbytes=fbytes + m * g * k * 4 + m * g * n * 4, flops=2 * m * g * n * k)
            if g == 1 and m >= 16 and m % 16 == 0:
                xq = xb.to(torch.float8_e4m3fn)
                one_a, one_b = torch.ones(m, 1, device="cuda"), torch.ones(1, g * n, device="cuda")
                base = time_us(lambda: torch._scaled_mm(xq, nq().t(), scale_a=one_a, scale_b=one_b,
                                                        out_dtype=torch.bfloat16))
                record("linear fp8 32x32", shape, ours, **row, base="_scaled_mm rowwise", base_us=base,
                       ceiling_tflops=FP8_TFLOPS)
            else:
                record("linear fp8 32x32", shape, ours, **row, ceiling_tflops=FP8_TFLOPS)
        del wb, wq


def bench_norms(tokens: list[int]) -> None:
    d, hc = 5120, 4
    for m in tokens:
        x, w = torch.randn(m, d, device="cuda"), torch.randn(d, device="cuda")
        record("rms_norm", f"{m}x{d} fp32", time_us(lambda: rms_norm.rms_norm(x, w, eps=1e-20)),
               nbytes=2 * m * d * 4 + d * 4, base="torch eager (dsl ref)",
               base_us=time_us(lambda: dense_ref.rms_norm(x, w, eps=1e-20)))
        h, pre = torch.randn(m, hc, d, device="cuda"), torch.rand(m, hc, device="cuda")
        record("hc_collapse_rms_norm", f"{m}x{hc}x{d}",
               time_us(lambda: hyper.hc_collapse_rms_norm(h, pre, w, eps=1e-20)),
               nbytes=(hc + 1) * m * d * 4, base="torch eager (dsl ref)",
               base_us=time_us(lambda: hyper_ref.hc_collapse_rms_norm(h, pre, w, eps=1e-20)))
        y, post = torch.randn(m, d, device="cuda"), torch.randn(m, hc, device="cuda")
        comb = torch.rand(m, hc, hc, device="cuda")
        record("hc_expand", f"{m}x{hc}x{d}", time_us(lambda: hyper.hc_expand(y, h, post, comb)),
               nbytes=(2 * hc + 1) * m * d * 4, base="torch eager (dsl ref)",
               base_us=time_us(lambda: hyper_ref.hc_expand(y, h, post, comb)))
        kv = torch.randn(m, (hc + 1) * d, device="cuda")
        qk = torch.randn(hc, d, device="cuda"), torch.randn(hc, d, device="cuda")
        record("engram_gate", f"{m}x{hc}x{d}", time_us(lambda: engram.engram_gate(h, kv, *qk, eps=1e-20)),
               nbytes=(3 * hc + 1) * m * d * 4 + 2 * hc * d * 4, base="torch eager (dsl ref)",
               base_us=time_us(lambda: engram_ref.engram_gate(h, kv, *qk, eps=1e-20)))
        q, positions = torch.randn(m, 64, 512, device="cuda"), torch.arange(m, device="cuda") + 1000
        yarn = rope_ref.rope_params({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "beta_fast": 32,
                                     "beta_slow": 1, "original_max_position_embeddings": 65536,
                                     "attention_factor": 1.0})
        freqs = rope_ref._freqs_on(yarn, 64, q.device)
        record("rope", f"q {m}x64x512 rope 64", time_us(lambda: rope.rope(q, positions, freqs)),
               nbytes=2 * q.numel() * 4, base="torch eager (dsl ref)",
               base_us=time_us(lambda: rope_ref.rotate(q, positions, yarn, 64, False)))
        fn = torch.randn(24, hc * d, device="cuda") * (hc * d) ** -0.5
        sc, base = torch.rand(3, device="cuda") + 0.5, torch.randn(24, device="cuda")
        kw = dict(iters=20, eps=1e-6, norm_eps=1e-20)
        cfg = tuned("hc_mixes", {"hc": hc, "d": d}, m)
        record("hc_mixes (sinkhorn)", f"{m}x{hc}x{d}",
               time_us(lambda: mixes.hc_mixes(h, fn, sc, base, **kw, config=cfg)),
               nbytes=m * hc * d * 4 + fn.numel() * 4, base="torch eager (dsl ref)",
               base_us=time_us(lambda: hyper_ref.hc_mixes(h, fn, sc, base, **kw)))


def bench_tilelang_norms(tokens: list[int]) -> None:
    """The TileLang RMSNorm's and collapse + RMSNorm's cubins through the CUDA driver at V4.1's widths, against the
    Triton kernels (baseline) and torch eager. Shapes that fit the L2 (50 MB) can pass the HBM ceiling."""
    from kernels.hyper.collapse_tilelang import hc_collapse_rms_norm as collapse_tilelang
    from kernels.launch import use_launcher
    from kernels.norm.rms_norm_tilelang import rms_norm as rms_norm_tilelang
    from tests.kernels.tilelang_cubins import cubin_launcher

    launcher = cubin_launcher()
    if launcher is None:
        raise RuntimeError("no TileLang cubins: build them with `python -m tests.kernels.tilelang_cubins`")

    def ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with use_launcher(launcher):
            return rms_norm_tilelang(x, w, eps=1e-20)

    def ours_collapse(h: torch.Tensor, pre: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with use_launcher(launcher):
            return collapse_tilelang(h, pre, w, eps=1e-20)

    d, hc = 5120, 4
    for m in tokens:
        h, pre = torch.randn(m, hc, d, device="cuda"), torch.rand(m, hc, device="cuda")
        w = torch.randn(d, device="cuda")
        torch.testing.assert_close(ours_collapse(h, pre, w), hyper_ref.hc_collapse_rms_norm(h, pre, w, eps=1e-20),
                                   rtol=1e-5, atol=1e-5)
        record("hc_collapse_rms_norm tl", f"{m}x{hc}x{d}", time_us(lambda: ours_collapse(h, pre, w)),
               nbytes=(hc + 1) * m * d * 4, base="triton kernel",
               base_us=time_us(lambda: hyper.hc_collapse_rms_norm(h, pre, w, eps=1e-20)),
               eager_us=time_us(lambda: hyper_ref.hc_collapse_rms_norm(h, pre, w, eps=1e-20)))

    for d in (5120, 1280, 512, 128):
        for m in tokens:
            x, w = torch.randn(m, d, device="cuda"), torch.randn(d, device="cuda")
            torch.testing.assert_close(ours(x, w), dense_ref.rms_norm(x, w, eps=1e-20), rtol=1e-5, atol=1e-5)
            record("rms_norm tilelang", f"{m}x{d} fp32", time_us(lambda: ours(x, w)), nbytes=2 * m * d * 4 + d * 4,
                   base="triton kernel", base_us=time_us(lambda: rms_norm.rms_norm(x, w, eps=1e-20)),
                   eager_us=time_us(lambda: dense_ref.rms_norm(x, w, eps=1e-20)))


def bench_moe(tokens: list[int]) -> None:
    """The plan's config (tuned, else the heuristic for the token bucket) on the codes in fragment order and bf16
    scale factors the executor gives the kernel on sm90, against the same kernel on raw codes, side by side
    (bench/bench_moe_decode.py: the decode sizes, more configs)."""
    e, inter, d, topk = 384, 2304, 5120, 6
    shapes = ((inter, d), (d, inter), (inter, d))
    raw = [torch.randint(0, 256, (e, o, i // 2), device="cuda", dtype=torch.uint8) for o, i in shapes]
    s32 = [torch.ldexp(torch.ones(e, o, i // 32, device="cuda"), torch.randint(-7, -3, (e, o, i // 32), device="cuda"))
           for o, i in shapes]
    ss = [moe.prescaled(s) for s in s32]
    forms = {"raw codes": raw, "fragments": [fragment_codes(w) for w in raw]}
    for m in tokens:
        routes = [torch.stack([torch.randperm(e, device="cuda")[:topk] for _ in range(m)]) for _ in range(4)]
        unique = sum(len(torch.unique(r)) for r in routes) / len(routes)
        x, wts = torch.randn(m, d, device="cuda"), torch.rand(m, topk, device="cuda")
        nr = cycler(routes)
        cfg = tuned("moe_experts", {"e": e, "inter": inter, "d": d, "topk": topk, "fmt": "fp4_fragments"}, m) \
            or moe.default_config(bucket_of(m))
        # each form timed twice, in one order then the reverse (a long compute-bound run heats the GPU and slows
        # what comes after it), keeping each one's faster time
        times: dict[str, list[float]] = {name: [] for name in forms}
        for order in (list(forms), list(forms)[::-1]):
            for name in order:
                times[name].append(time_us(lambda w=forms[name]: moe.moe_experts(x, wts, nr(), *w, *ss, limit=10.0,
                                                                                  config=cfg)))
        # the reference synchronizes (torch.unique(...).tolist()): timed with events, and only where it is quick
        eager = time_us(lambda: moe_ref.moe_experts(x, wts, routes[0], *raw, *s32, limit=10.0), 10, graph=False) \
            if m <= 16 else None
        splits = f"split {cfg['up'].get('split_k', 1)}/{cfg['down'].get('split_k', 1)}"
        per_expert = sum(w[0].numel() + s[0].numel() * s.element_size() for w, s in zip(raw, ss, strict=True))
        for name in forms:
            record(f"moe fp4 experts {name}", f"T={m} E=384 top6 {d}<->{inter} ({unique:.0f} experts) {splits}",
                   min(times[name]), nbytes=unique * per_expert + m * d * 8, flops=6 * m * topk * d * inter,
                   base="raw codes", base_us=min(times["raw codes"]), eager_us=eager)


def torch_sparse_attention(q, kv, idx, sink, scale):
    valid = idx >= 0
    keys = kv[idx.clamp_min(0).long()].float()  # [T, S, D]
    logits = torch.einsum("thd,tsd->ths", q.float(), keys) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    full = torch.cat([logits, sink.float()[None, :, None].expand(q.shape[0], -1, 1)], -1)
    probs = torch.softmax(full, -1)[..., :-1]
    return torch.einsum("ths,tsd->thd", probs, keys)


def bench_attention(tokens: list[int]) -> None:
    h, d, s, pool = 64, 512, 128 + 512, 2128
    for m in tokens:
        q = torch.randn(m, h, d, device="cuda").bfloat16()
        kv = torch.randn(m * pool, d, device="cuda").bfloat16()
        idx = torch.stack([torch.randperm(pool, device="cuda")[:s] + pool * i for i in range(m)]).int()
        sink = torch.randn(h, device="cuda")
        cfg = tuned("sparse_attention", {"h": h, "d": d}, m)
        ours = time_us(lambda: attention.sparse_attention(q, kv, idx, sink, scale=d**-0.5, config=cfg))
        base = time_us(lambda: torch_sparse_attention(q, kv, idx, sink, d**-0.5))
        record("sparse_attention decode", f"T={m} H={h} D={d} S={s}", ours,
               nbytes=m * (s * d * 2 + h * d * 2 + h * d * 4 + s * 4), flops=4 * m * h * s * d,
               base="torch eager (gather+softmax)", base_us=base)


def bench_indexer(tokens: list[int], entries: int = 2048) -> None:
    """Decode: each token against its own sequence's `entries` compressed keys (8192 tokens at ratio 4)."""
    h, d = 64, 128
    for m in tokens:
        q = torch.randn(m, h, d, device="cuda").bfloat16()
        w = torch.randn(m, h, device="cuda")
        keys = torch.randn(m * entries, d, device="cuda").bfloat16()
        start = (torch.arange(m, device="cuda") * entries).int()
        length = torch.full((m,), entries, dtype=torch.int32, device="cuda")
        pos = torch.full((m,), 4 * entries + 3, dtype=torch.int32, device="cuda")
        cfg = tuned("index_scores", {"h": h, "d": d}, m)

        def torch_scores():
            s = torch.einsum("thd,tld->thl", q.float(), keys.view(m, entries, d).float()).relu_() * d**-0.5
            return (s * (w * h**-0.5)[..., None]).sum(1)

        ours = time_us(lambda: indexer.index_scores(q, w, keys, start, length, pos, ratio=4, width=entries,
                                                    config=cfg))
        record("index_scores decode", f"T={m} H={h} D={d} L={entries}", ours,
               nbytes=m * (entries * d * 2 + h * d * 2 + h * 4 + entries * 4), flops=2 * m * h * entries * d,
               base="torch eager (einsum)", base_us=time_us(torch_scores))


def bench_cache(rows: list[int], blocks: int = 4096, per: int = 64, width: int = 16) -> None:
    """Cache entries stored (encode + scatter) and loaded (gather + decode) by kernels/cache/rows.py against the
    torch path of dsl/cache.py, µs per call issued eagerly as a step issues them (host time included): the window
    (fp8, by slot), the compressed KV (fp4, e4m3 scales) and the indexer keys (fp4, power-of-two scales), by table."""
    import kernels.cache.rows as cache
    from dsl import cache as torch_cache
    from dsl.cache_format import EntryFormat
    from dsl.ops.rounding import fp4_round, fp8_round

    for name, fmt, d, paged in [("window fp8", EntryFormat("fp8", 32), 512, False),
                                ("kv fp4 e4m3", EntryFormat("fp4", 16, True), 512, True),
                                ("index fp4", EntryFormat("fp4", 32), 128, True)]:
        with torch.device("cuda"):
            parts = fmt.storage((blocks, per), d)
        tables = torch.randperm(blocks, device="cuda").reshape(-1, width) if paged else None
        for m in rows:
            x = torch.randn(m, d, device="cuda")
            x = fp8_round(x, block=32) if fmt.kind == "fp8" else fp4_round(x, block=fmt.block,
                                                                             e4m3_scale=fmt.e4m3_scale)
            major = torch.randperm(blocks // width if paged else blocks, device="cuda")[:m]
            minor = torch.randint(0, per * (width if paged else 4), (m,), device="cuda")
            args = (fmt, parts, x, major, minor, tables)
            nbytes = m * (d * 4 + fmt.entry_bytes(d))
            record(f"cache store {name}", f"B={m} D={d}", time_us(lambda a=args: cache.store_rows(*a), graph=False),
                   nbytes=nbytes, base="torch encode+scatter", base_us=time_us(
                       lambda a=args: torch_cache.store_rows(*a), graph=False))
            args = (fmt, parts, major, minor, tables)
            record(f"cache load {name}", f"B={m} D={d}", time_us(lambda a=args: cache.load_rows(*a), graph=False),
                   nbytes=nbytes, base="torch gather+decode", base_us=time_us(
                       lambda a=args: torch_cache.load_rows(*a), graph=False))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_results.json")
    p.add_argument("--tuning", help="a tuning cache (JSON) whose configs the kernels use")
    p.add_argument("--only", help="comma-separated parts: " + ",".join([*PARTS, *SWEEPS]))
    args = p.parse_args()
    global TUNED
    TUNED = TuningCache(args.tuning) if args.tuning else None
    torch.manual_seed(0)
    print("device:", torch.cuda.get_device_name(), flush=True)
    for name in args.only.split(",") if args.only else PARTS:
        try:
            (PARTS | SWEEPS)[name]()
        except Exception as e:  # one failing family must not hide the others' numbers
            print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(ROWS, indent=1))
    print_table(ROWS)
    return 0


TOKENS = [1, 16, 64]
PARTS = {"ceilings": ceilings, "linear": lambda: bench_linear(TOKENS), "prefill_gemm": bench_prefill_gemm,
         "prefill_switch": bench_prefill_switch,
         "norms": lambda: bench_norms([1, 64, 4096]), "tilelang": lambda: bench_tilelang_norms([1, 64, 4096]),
         "norm_e4m3": lambda: bench_norm_e4m3([1, 64, 8192]), "swiglu": lambda: bench_swiglu([*TOKENS, 8192]),
         "engram": lambda: bench_engram_lookup([1, 64, 8192]),
         "moe": lambda: bench_moe([*TOKENS, 1024, 8192]), "gate_route": lambda: bench_gate_route([1, 64, 8192]),
         "attention": lambda: bench_attention(TOKENS),
         "indexer": lambda: bench_indexer(TOKENS), "topk": lambda: bench_topk([1, 64, 2048]),
         "cache": lambda: bench_cache([1, 16, 64]), "sampling": lambda: bench_sampling([1, 16, 64, 256])}
SWEEPS = {"topk_tiles": lambda: bench_topk_tiles([1, 64, 2048])}  # tile sweeps: run only when named in --only


def print_table(rows: list[dict]) -> None:
    print(f"\n{'kernel':26s} {'shape':44s} {'us':>8s} {'TB/s':>6s} {'%HBM':>5s} {'TFLOP/s':>7s} {'%pk':>5s} "
          f"{'base us':>8s} {'x base':>6s} {'x eager':>7s}")
    for r in rows:
        print(f"{r['kernel'][:26]:26s} {r['shape'][:44]:44s} {r['us']:8.2f} {r.get('TB/s', ''):>6} "
              f"{r.get('%HBM', ''):>5} {r.get('TFLOP/s', ''):>7} {r.get('%peak', ''):>5} "
              f"{r.get('base_us', ''):>8} {r.get('speedup', ''):>6} {r.get('x eager', ''):>7}")


if __name__ == "__main__":
    sys.exit(main())
