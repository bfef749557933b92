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

import torch

from autotune.cache import TuningCache, cache_key, default_cache, template_hash
from autotune.space import get_configs
from autotune.tune import tune
from kernels.lowering import PLAIN, Static
from kernels.registry import TEMPLATES, TUNINGS, tunable
from kernels.targets import DEFAULT_GPU_TARGET, TARGETS, cubin_targets
from kernels.tuning import Job

V41 = {"hidden_size": 5120, "q_lora_rank": 1280, "num_attention_heads": 64, "head_dim": 512, "o_groups": 8,
       "o_lora_rank": 1024, "n_routed_experts": 384, "num_experts_per_tok": 6, "moe_intermediate_size": 2304,
       "hc_mult": 4, "sliding_window": 128, "index_topk": 512, "index_n_heads": 32, "index_head_dim": 128,
       "vocab_size": 129280}


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


def statics(cfg: dict) -> list[tuple[str, Static]]:
    """(template, static shapes) of every tunable kernel node kind of a config, as `make_plan` keys them: each
    family's `Tuning.shapes` (kernels/<family>/tuning.py)."""
    return [(template, st) for template in tunable() for st in TUNINGS[template].shapes(cfg)]


def _shape(st: Static) -> str:
    return ",".join(f"{k}={v}" for k, v in st.fields().items())


def select_work(cfg: dict, templates: list[str], buckets: list[int], only: dict[str, str] | None = None
                ) -> list[tuple[str, Static, int]]:
    """(template, static shapes, token bucket) of every job to tune; ValueError on an unknown template or a bucket
    that is not a positive integer. Jobs in buckets where plans run a kernel this tuner does not search (the linear
    family's prefill GEMM, `Lowering.tunable`) are left out, said on stderr: that kernel keeps its heuristic tiles."""
    known = tunable()
    unknown = [t for t in templates if t not in known]
    if unknown:
        raise ValueError(f"unknown template(s) {', '.join(unknown)}; tunable: {', '.join(known)}")
    if not buckets or any(b <= 0 for b in buckets):
        raise ValueError(f"buckets must be positive token counts, got {buckets}")
    only = only or {}
    work = [(t, st, b) for t, st in statics(cfg) if t in templates
            and all(str(st.fields().get(k)) == v for k, v in only.items()) for b in buckets]
    kept, left = [], {}
    for t, st, b in work:
        gemms = TEMPLATES[t].gemms(st, b, False)
        if TEMPLATES[t].tunable(gemms):
            kept.append((t, st, b))
        else:
            left.setdefault((t, "/".join(gemms)), []).append(f"{_shape(st)} at {b}")
    for (t, gemms), shapes in left.items():
        print(f"{t} left out where plans run the {gemms} GEMM, which keeps its heuristic tiles: {', '.join(shapes)}",
              file=sys.stderr)
    return kept


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


def job(template: str, st: Static, m: int, cfg: dict) -> Job:
    """(run(config) -> output, reference output, tolerance) on fresh random inputs of `m` tokens."""
    tuning = TUNINGS.get(template)
    if tuning is None or tuning.job is None:
        raise ValueError(f"no tuning job for {template}")
    return tuning.job(st, m, cfg)


def heuristic(template: str, st: Static, m: int) -> dict:
    """The config a plan runs untuned for these shapes and bucket (a bucket the tuner searches)."""
    lowering = TEMPLATES[template]
    return lowering.default_config(st, m, PLAIN, lowering.gemms(st, m, False))


def _warm(task: tuple[str, Static, int, dict, list[dict]]) -> int:
    """Compile (by running once) a share of the candidates in a worker process: Triton's on-disk cache then
    serves the timing process, so compiles spread over the host's cores."""
    template, st, bucket, cfg, configs = task
    warmup = TUNINGS[template].warmup
    st = st if warmup is None else warmup(st)
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


def precompile(work: list[tuple[str, Static, int]], cfg: dict, target: str, jobs: int) -> None:
    import multiprocessing

    tasks = []
    for template, st, bucket in work:
        configs = get_configs(template, st, bucket, target)
        tasks += [(template, st, bucket, cfg, configs[i::jobs]) for i in range(min(jobs, len(configs)))]
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        pool.map(_warm, tasks, chunksize=1)


def tune_all(work: list[tuple[str, Static, int]], cfg: dict, target: str, cache: TuningCache, jobs: int = 8,
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
        default = next((t for t in trials if t.config == heuristic(template, st, bucket)), None)
        if best is not None:
            key = cache_key(template, TEMPLATES[template].key(st, PLAIN), bucket, target, device,
                            template_hash(template))
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
        shapes = _shape(st)
        lines.append(f"{template:17s} {shapes:44s} {bucket:5d} {n:4d} {rej:3d} {us:8.2f} "
                     f"{dus if dus is None else round(dus, 2)!s:>8s}  {best}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The tuning flags, shared by `python -m autotune.run` and `deepinfer autotune`."""
    p.add_argument("--config", help="a config.json or model directory (default: the full V4.1-Flash sizes)")
    p.add_argument("--target", default=DEFAULT_GPU_TARGET,
                   help=f"{' or '.join(t.name for t in cubin_targets())}: the GPU here must be of that architecture")
    p.add_argument("--buckets", default="16,64", help="token-count buckets to tune, comma-separated (default 16,64)")
    p.add_argument("--templates", default=",".join(tunable()), help=f"comma-separated subset of {','.join(tunable())}")
    p.add_argument("--out", help="cache file (default: autotune/tuned/<target>.json)")
    p.add_argument("--jobs", type=int, default=8, help="processes compiling candidates ahead of timing")
    p.add_argument("--only", default="", help="key=value: tune only the static shapes that match, e.g. fmt=fp8")


def prepare(args: argparse.Namespace) -> tuple[dict, list[tuple[str, Static, int]]]:
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


if __name__ == "__main__":
    sys.exit(main())
