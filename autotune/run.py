"""Tune the kernel nodes of a DeepSeek-V4.1 config on the current GPU and write the tuning cache.

    python -m autotune.run --config config.json --target sm90 [--templates linear,moe_experts] [--out file]
    deepinfer autotune ...   (the same flags, with a progress bar: deepinfer/autotune_cli.py)

The static shapes come from the config's Hugging Face fields (hidden_size, q_lora_rank, ...); inputs are fresh
random values; each candidate's output must match the DSL reference (on bf16-rounded operands) before it is
timed (CUDA-graph replays, median). Prints a summary table; the cache file is what `make_plan` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import torch

import kernels.attention.sparse_attention as attention
import kernels.hyper.hyper as hyper
import kernels.linear.linear as linear
import kernels.linear.prefill as linear_prefill
import kernels.moe.experts as moe
from autotune.cache import TuningCache, cache_key, default_cache, source_hash
from autotune.space import get_configs
from autotune.tune import tune
from dsl.ops import dense
from dsl.ops import hyper as hyper_ref
from dsl.quant import quantize_fp8_block
from kernels.targets import DEFAULT_GPU_TARGET, TARGETS, cubin_targets

V41 = {"hidden_size": 5120, "q_lora_rank": 1280, "num_attention_heads": 64, "head_dim": 512, "o_groups": 8,
       "o_lora_rank": 1024, "n_routed_experts": 384, "num_experts_per_tok": 6, "moe_intermediate_size": 2304,
       "hc_mult": 4, "sliding_window": 128, "index_topk": 512, "index_n_heads": 32, "index_head_dim": 128,
       "vocab_size": 129280}
MODULES = {"linear": linear, "moe_gate": linear, "moe_experts": moe, "sparse_attention": attention,
           "hc_mixes": hyper}


def load_config(path: str | os.PathLike | None) -> dict:
    """The tuning-relevant fields of a Hugging Face config.json (flat or under `text_config`; a model directory
    names its config.json), the full V4.1-Flash sizes for those it lacks. Raises ValueError naming what is wrong."""
    cfg = dict(V41)
    if path is None:
        return cfg
    file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
    if not os.path.exists(file):
        raise ValueError(f"no config file at {os.fspath(path)!r}")
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    text = raw.get("text_config", raw) if isinstance(raw, dict) else None
    if not isinstance(text, dict):
        raise ValueError(f"{file} must hold a JSON object (a Hugging Face config.json)")
    given = {k: v for k, v in text.items() if k in V41}
    if not given:
        raise ValueError(f"{file} has none of the fields tuning reads ({', '.join(V41)}): is it a model config?")
    for key, value in given.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"config field `{key}` must be a positive integer, got {value!r}")
    cfg |= given
    if cfg["num_attention_heads"] % cfg["o_groups"]:
        raise ValueError(f"`num_attention_heads` ({cfg['num_attention_heads']}) is not a multiple of `o_groups` "
                         f"({cfg['o_groups']})")
    return cfg


def statics(cfg: dict) -> list[tuple[str, dict]]:
    """(template, static shapes) of every tunable kernel node kind of a config, as `make_plan` keys them."""
    h, heads, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    g, r, q = cfg["o_groups"], cfg["o_lora_rank"], cfg["q_lora_rank"]
    both, plain = ("plain", "fp8"), ("plain",)
    # (n, k, groups, formats): wq_a, wq_b, wkv (and the compressor's wkv / wgate), wo_a, wo_b, the indexer's wq_b
    # (checkpoints store these in fp8, tests in float), then the always-float indexer weights_proj and head
    linears = [(q, h, 1, both), (heads * d, q, 1, both), (d, h, 1, both), (r, heads // g * d, g, both),
               (h, g * r, 1, both), (cfg["index_n_heads"] * cfg["index_head_dim"], q, 1, both),
               (cfg["index_n_heads"], h, 1, plain), (cfg["vocab_size"], h, 1, plain)]
    out = []
    for n, k, groups, fmts in linears:
        for fmt in fmts:
            st = ("linear", {"n": n, "k": k, "groups": groups, "fmt": fmt})
            if st not in out:
                out.append(st)
    out.append(("moe_gate", {"e": cfg["n_routed_experts"], "d": h}))
    out.append(("moe_experts", {"e": cfg["n_routed_experts"], "inter": cfg["moe_intermediate_size"], "d": h,
                                "topk": cfg["num_experts_per_tok"], "fmt": "fp4"}))
    out.append(("sparse_attention", {"h": heads, "d": d}))
    out.append(("hc_mixes", {"hc": cfg["hc_mult"], "d": h}))
    return out


def select_work(cfg: dict, templates: list[str], buckets: list[int], only: dict[str, str] | None = None
                ) -> list[tuple[str, dict, int]]:
    """(template, static shapes, token bucket) of every job to tune; ValueError on an unknown template or a bucket
    that is not a positive integer. Linears in buckets where plans run the prefill GEMM (`linear_prefill.serves`)
    are left out (said on stderr): this tuner does not search its configs, and a linear.py config cached for such
    a bucket would take its place."""
    unknown = [t for t in templates if t not in MODULES]
    if unknown:
        raise ValueError(f"unknown template(s) {', '.join(unknown)}; tunable: {', '.join(MODULES)}")
    if not buckets or any(b <= 0 for b in buckets):
        raise ValueError(f"buckets must be positive token counts, got {buckets}")
    only = only or {}
    work = [(t, st, b) for t, st in statics(cfg) if t in templates
            and all(str(st.get(k)) == v for k, v in only.items()) for b in buckets]
    prefill = [(st, b) for t, st, b in work if t == "linear" and linear_prefill.serves(b, st["n"], st["groups"],
                                                                                          st["fmt"] == "fp8")]
    if prefill:
        left = ", ".join(f"{st['groups']}x{st['n']}x{st['k']} {st['fmt']} at {b}" for st, b in prefill)
        print(f"linear left out where plans run the prefill GEMM, which keeps its heuristic tiles: {left}",
              file=sys.stderr)
    return [(t, st, b) for t, st, b in work if t != "linear" or (st, b) not in prefill]


def check_device(target: str) -> str:
    """The name of this machine's GPU when it can tune for `target`; RuntimeError saying why not otherwise."""
    spec = TARGETS.get(target)
    if spec is None or not spec.builds_cubins:
        raise ValueError(f"no tuning for target {target!r}; targets: {', '.join(t.name for t in cubin_targets())}")
    if not torch.cuda.is_available():
        raise RuntimeError("autotuning needs a CUDA GPU of the target's architecture; this machine has none")
    name, cap = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    if tuple(cap) != spec.compute_capability:
        major, minor = spec.compute_capability
        raise RuntimeError(f"autotuning for {target} needs a CUDA GPU of that architecture (sm_{major}{minor}); "
                           f"this machine has {name} (sm_{cap[0]}{cap[1]})")
    return name


def rotation(w: torch.Tensor, total_bytes: int = 256 << 20) -> list[torch.Tensor]:
    """Copies of `w` (same values, separate memory) adding up to more than the L2, cycled through by timing."""
    count = max(2, -(-total_bytes // (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(count - 1)]


def job(template: str, st: dict, m: int, cfg: dict) -> tuple[Callable[[dict], torch.Tensor], torch.Tensor, float]:
    """(run(config) -> output, reference output, tolerance) on fresh random inputs of `m` tokens."""
    dev = "cuda"
    if template == "linear":
        n, k, groups = st["n"], st["k"], st["groups"]
        w = torch.randn(groups * n, k, device=dev) * k**-0.5
        if st["fmt"] == "fp8":
            w, s = quantize_fp8_block(w)
        else:
            w, s = w.bfloat16(), None
        x = torch.randn(m, groups * k, device=dev)
        xr = x.bfloat16().float()
        ref = dense.linear(xr, w, s) if groups == 1 else dense.grouped_linear(xr, w, s, groups=groups)
        copies = rotation(w)  # equal copies past the L2: each call streams its weight from HBM, as in a model
        step = iter(range(1 << 62))
        return (lambda c: linear.linear(x, copies[next(step) % len(copies)], s, groups=groups, config=c)), ref, 1e-4
    if template == "moe_gate":  # fp32 weights and products, as graphs/lowering_linear.py runs the gate
        w = torch.randn(st["e"], st["d"], device=dev) * st["d"] ** -0.5
        x = torch.randn(m, st["d"], device=dev)
        ref = (x.double() @ w.double().t()).float()
        return (lambda c: linear.linear(x, w, config=c, dot_fp32=True)), ref, 1e-5
    if template == "moe_experts":
        e, inter, d, topk = st["e"], st["inter"], st["d"], st["topk"]
        ws = [torch.randint(0, 256, (e, o, i // 2), device=dev, dtype=torch.uint8) for o, i in ((inter, d), (d, inter),
                                                                                               (inter, d))]
        ss = [moe.prescaled(torch.ldexp(torch.ones(e, o, i // 32, device=dev),
                                        torch.randint(-7, -3, (e, o, i // 32), device=dev)))
              for o, i in ((inter, d), (d, inter), (inter, d))]  # the form the executor gives the kernel
        experts = torch.stack([torch.randperm(e, device=dev)[:topk] for _ in range(m)])
        weights = torch.rand(m, topk, device=dev)
        x = torch.randn(m, d, device=dev)
        args = (x, weights, experts, ws[0], ws[1], ws[2], ss[0], ss[1], ss[2])
        ref = moe.moe_experts(*args, limit=10.0, config=moe.default_config(m))
        return (lambda c: moe.moe_experts(*args, limit=10.0, config=c)), ref, 1e-3
    if template == "sparse_attention":
        h, d, s = st["h"], st["d"], cfg["sliding_window"] + cfg["index_topk"]
        q = torch.randn(m, h, d, device=dev).bfloat16()
        kv = torch.randn(m * 2 * s, d, device=dev).bfloat16()
        idx = torch.stack([torch.randperm(2 * s, device=dev)[:s] + 2 * s * i for i in range(m)]).int()
        sink = torch.randn(h, device=dev)
        ref = attention.sparse_attention(q.float(), kv.float(), idx, sink, scale=d**-0.5, dot_fp32=True)
        return (lambda c: attention.sparse_attention(q, kv, idx, sink, scale=d**-0.5, config=c)), ref, 1e-2
    if template == "hc_mixes":
        hc, d = st["hc"], st["d"]
        args = (torch.randn(m, hc, d, device=dev), torch.randn((2 + hc) * hc, hc * d, device=dev) * (hc * d) ** -0.5,
                torch.rand(3, device=dev) + 0.5, torch.randn((2 + hc) * hc, device=dev))
        ref = torch.cat([t.reshape(m, -1) for t in hyper_ref.hc_mixes(*args, iters=20, eps=1e-6, norm_eps=1e-20)], 1)
        return (lambda c: torch.cat([t.reshape(m, -1) for t in hyper.hc_mixes(*args, iters=20, eps=1e-6,
                                                                              norm_eps=1e-20, config=c)], 1)), ref, 1e-4
    raise ValueError(f"no tuning job for {template}")


def _warm(task: tuple[str, dict, int, dict, list[dict]]) -> int:
    """Compile (by running once) a share of the candidates in a worker process: Triton's on-disk cache then
    serves the timing process, so compiles spread over the host's cores."""
    template, st, bucket, cfg, configs = task
    if template == "moe_experts":  # the expert count is a runtime size: a few experts compile the same kernels
        st = dict(st, e=min(st["e"], 16))
    try:  # the token count is a runtime size too: at most 512 (a multiple of 16, as the buckets past it are), so
        # workers in parallel do not each hold a prefill bucket's inputs (8192 tokens of attention: 20 GiB)
        run, _, _ = job(template, st, min(bucket, 512), cfg)
    except Exception as e:  # the timing process meets the same error and reports it
        print(f"precompile {template} {st}: {type(e).__name__}: {e}", flush=True)
        return 0
    done = 0
    for config in configs:
        try:
            run(config)
            done += 1
        except Exception:  # rejected later, in the timing process, with its error
            pass
    torch.cuda.synchronize()
    return done


def precompile(work: list[tuple[str, dict, int]], cfg: dict, target: str, jobs: int) -> None:
    import multiprocessing

    tasks = []
    for template, st, bucket in work:
        configs = get_configs(template, st, bucket, target)
        tasks += [(template, st, bucket, cfg, configs[i::jobs]) for i in range(min(jobs, len(configs)))]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_warm, tasks, chunksize=1)


def tune_all(work: list[tuple[str, dict, int]], cfg: dict, target: str, cache: TuningCache, jobs: int = 8,
             progress: bool = True) -> list[tuple]:
    """Tune every job on this GPU, saving `cache` after each; returns the summary rows (template, static, bucket,
    candidates, rejected, best us, heuristic us, best config)."""
    from tqdm import tqdm

    if jobs > 1:
        precompile(work, cfg, target, jobs)
    device = torch.cuda.get_device_name()
    rows = []
    for template, st, bucket in tqdm(work, desc="tuning", unit="job", file=sys.stdout, disable=not progress):
        configs = get_configs(template, st, bucket, target)
        try:
            run, ref, tol = job(template, st, bucket, cfg)
        except Exception as e:
            print(f"skipped {template} {st} m<={bucket}: {type(e).__name__}: {e}", flush=True)
            continue
        best, trials = tune(configs, run, ref, tol, rep_ms=10)
        default = next((t for t in trials if t.config == _default(template, st, bucket)), None)
        if best is not None:
            key = cache_key(template, st, bucket, target, device, source_hash(MODULES[template]))
            us = min(t.us for t in trials if t.us is not None)
            cache.put(key, best, us)
            cache.save()  # after every job: a run stopped midway keeps what it measured
            rows.append((template, st, bucket, len(configs), sum(t.us is None for t in trials), us,
                         default.us if default else None, best))
        else:
            print(f"no candidate passed for {template} {st} m<={bucket}", flush=True)
    cache.save()
    return rows


def summary(rows: list[tuple]) -> str:
    """The table of `tune_all`'s rows: per job the candidates, rejections, best and heuristic times, best config."""
    header = (f"{'template':17s} {'static':44s} {'m<=':>5s} {'cfgs':>4s} {'rej':>3s} {'best us':>8s} "
              f"{'heur us':>8s}  best")
    lines = [header]
    for template, st, bucket, n, rej, us, dus, best in rows:
        shapes = ",".join(f"{k}={v}" for k, v in st.items())
        lines.append(f"{template:17s} {shapes:44s} {bucket:5d} {n:4d} {rej:3d} {us:8.2f} "
                     f"{dus if dus is None else round(dus, 2)!s:>8s}  {best}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tuning flags, shared by `python -m autotune.run` and `deepinfer autotune`."""
    p.add_argument("--config", help="a config.json or model directory (default: the full V4.1-Flash sizes)")
    p.add_argument("--target", default=DEFAULT_GPU_TARGET,
                   help=f"{' or '.join(t.name for t in cubin_targets())}: the GPU here must be of that architecture")
    p.add_argument("--buckets", default="16,64", help="token-count buckets to tune, comma-separated (default 16,64)")
    p.add_argument("--templates", default=",".join(MODULES), help=f"comma-separated subset of {','.join(MODULES)}")
    p.add_argument("--out", help="cache file (default: autotune/tuned/<target>.json)")
    p.add_argument("--jobs", type=int, default=8, help="processes compiling candidates ahead of timing")
    p.add_argument("--only", default="", help="key=value: tune only the static shapes that match, e.g. fmt=fp8")


def prepare(args: argparse.Namespace) -> tuple[dict, list[tuple[str, dict, int]]]:
    """(config fields, jobs) from parsed flags, checked before any GPU work; ValueError naming what is wrong."""
    cfg = load_config(args.config)
    try:
        buckets = [int(b) for b in args.buckets.split(",") if b]
        only = dict(kv.split("=", 1) for kv in args.only.split(",") if kv)
    except ValueError:
        raise ValueError(f"--buckets takes integers and --only key=value pairs, got {args.buckets!r} / "
                         f"{args.only!r}") from None
    return cfg, select_work(cfg, [t for t in args.templates.split(",") if t], buckets, only)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        cfg, work = prepare(args)
        check_device(args.target)
    except (ValueError, RuntimeError) as e:
        p.error(str(e))
    cache = TuningCache(args.out) if args.out else default_cache(args.target)
    rows = tune_all(work, cfg, args.target, cache, args.jobs)
    print("\n" + summary(rows))
    print(f"wrote {cache.path}")
    return 0


def _default(template: str, st: dict, m: int) -> dict:
    if template == "linear":
        return linear.default_config(m, st["n"], st["k"], st["groups"], st["fmt"] == "fp8")
    if template == "moe_experts":
        return moe.default_config(m)
    if template == "moe_gate":  # as graphs/lowering_linear.py's MOE_GATE: fp32 weights
        return linear.default_config(m, st["e"], st["d"], w_bytes=4)
    if template == "sparse_attention":
        return attention.default_config(m, st["h"], st["d"])
    return hyper.mixes_config(m, st["hc"] * st["d"])


if __name__ == "__main__":
    sys.exit(main())
