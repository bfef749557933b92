"""DSpark drafting end to end: tokens/s with drafting off, static draft lengths and confidence scheduling.

    python bench/dspark_bench.py [--model DIR] [--batches 1,16,64] [--max-tokens 64] [--min-requests 8]
                                 [--device cpu|cuda | --target sm90] [--out f.json]

Prompts are the first lines of functions from the Python standard library files the checkpoint held out of its
training (train/README.md), so acceptance reflects text the drafter has not memorised. Every mode generates the
same requests (greedy, batch-invariant, so the outputs are identical and checked to be); it reports per-position
acceptance, mean tokens per verifying step and tokens/s of a whole `generate` call, after `--warmups` calls with the
same requests (they load the kernels and capture the CUDA graphs of the token-count buckets the run meets: a one-time
cost a long offline run amortises; the first one's tokens/s is reported as "cold"). Confidence
scheduling ("confidence k/budget") proposes k drafts a step and is run at several verification budgets (tokens per
step for all running requests), with the draft distribution's probabilities as confidences instead of the
confidence head's ("conf-draft k/budget"), and with draft blocks sized per request ("adaptive k/budget": two more
than the drafts it accepted last, at most k); `--regex` constrains every request (structured outputs drafting under the
grammar's masks). A batch of b runs max(b, --min-requests) requests, b at a time, so a batch of 1 is not one
prompt's luck. `--passes` runs the modes several times in alternating order and prints each one's median, and each
mode's ratio to the best static length within a pass (median over passes); `--interleave` builds every mode's engine
once first, so a pass times each mode once, seconds apart.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from node_timing import time_nodes, timer  # noqa: E402

from deepinfer import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from graphs.plan_runtime import PlanRuntime  # noqa: E402

DEFAULT_MODEL = ROOT / "deepinfer" / "checkpoints" / "v41-tiny-stdlib"


def prompts_from_stdlib(count: int) -> list[str]:
    """`count` prompts: a def line and the line after it, from held-out standard library files, in a fixed order."""
    import sysconfig

    held_out = []
    record = DEFAULT_MODEL / "train_record.json"
    if record.exists():
        held_out = json.loads(record.read_text()).get("held_out_files", [])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f for f in held_out] or sorted(stdlib.glob("*.py"))[::7]
    out = []
    for path in files:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith("def ") and len(out) < count:
                out.append(line + "\n" + lines[i + 1] + "\n")
        if len(out) >= count:
            break
    if len(out) < count:
        out = (out * (count // max(1, len(out)) + 1))[:count]
    return out


def time_phases(llm: LLM, nodes: bool) -> tuple[collections.Counter, collections.Counter]:
    """Wrap the engine's phases in timers that synchronise the device around them (so each phase holds its GPU
    work): scheduling, taking a step's tokens, the runner's step, and within it the forward, the draft forward and
    the proposing; with `nodes`, every node of the two forwards too (by op). Returns (ms, calls) by phase, filled as
    the engine runs."""
    ms, calls = collections.Counter(), collections.Counter()
    timed = timer(ms, calls)

    def wrap(owner, name: str, label: str) -> None:
        fn = getattr(owner, name)
        setattr(owner, name, lambda *a, **k: timed(label, fn, *a, **k))

    engine = llm.engine
    wrap(engine, "_schedule", "schedule")
    wrap(engine, "_postprocess", "postprocess")
    wrap(engine.runner, "execute", "runner")
    wrap(llm.compiled, "step", "forward")
    if engine.runner.speculator is not None:
        wrap(engine.runner.speculator.drafter, "propose", "propose")
        wrap(llm.compiled, "draft", "draft forward")
    if nodes:
        if not isinstance(llm.compiled.runtime, PlanRuntime):
            raise SystemExit("--phases nodes times a GPU target's executors: pass --target sm90")
        main, draft = llm.compiled.runtime.executors()
        time_nodes(main, timed, "  forward: ")
        if draft is not None:
            time_nodes(draft, timed, "  draft: ")
    return ms, calls


def prepare_mode(model: str, speculative: dict | None, prompts: list[str], batch: int, max_tokens: int,
                 device_kwargs: dict, regex: str | None = None, warmups: int = 2) -> tuple[LLM, SamplingParams, float]:
    """A mode's engine after `warmups` untimed runs of the requests: (llm, sampling params, the first run's seconds)."""
    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=max(512, 8 * batch),
              speculative_config=speculative, **device_kwargs)
    constraint = StructuredOutputsParams(regex=regex) if regex else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, structured_outputs=constraint)
    cold = 0.0
    for _ in range(warmups):  # kernels load; graphs capture at the token counts the run meets twice
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        cold = cold or time.perf_counter() - start
    return llm, params, cold


def run_mode(model: str, speculative: dict | None, prompts: list[str], batch: int, max_tokens: int,
             device_kwargs: dict, regex: str | None = None, profile: int = 0, timed_phases: str | None = None,
             kernels: int = 0, warmups: int = 2) -> dict:
    llm, params, cold = prepare_mode(model, speculative, prompts, batch, max_tokens, device_kwargs, regex, warmups)
    return timed_run(llm, params, prompts, cold, profile, timed_phases, kernels)


def segment_captures(llm: LLM) -> int:
    """CUDA-graph segments captured so far by the engine's executors (0 without graphs): a timed run that captures
    measures the captures, not the steady state the warm-ups are there to reach."""
    runtime = llm.compiled.runtime
    if not isinstance(runtime, PlanRuntime):
        return 0
    return sum(e.cuda_graphs.captures for e in runtime.executors() if e is not None and e.cuda_graphs is not None)


def timed_run(llm: LLM, params: SamplingParams, prompts: list[str], cold: float = 0.0, profile: int = 0,
              timed_phases: str | None = None, kernels: int = 0) -> dict:
    """One timed `generate` of the requests on a prepared engine, with its acceptance and outputs."""
    profiler = cProfile.Profile() if profile else None
    phases = time_phases(llm, timed_phases == "nodes") if timed_phases else None
    activity = torch.profiler.ProfilerActivity
    traced = torch.profiler.profile(activities=[activity.CUDA if torch.cuda.is_available() else activity.CPU]) \
        if kernels else None
    captured = segment_captures(llm)
    start = time.perf_counter()
    with profiler or contextlib.nullcontext(), traced or contextlib.nullcontext():
        outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    captured = segment_captures(llm) - captured
    if traced is not None:
        key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(traced.key_averages().table(sort_by=key, row_limit=kernels, max_name_column_width=60))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(profile)
    if phases is not None:
        ms, calls = phases
        steps = max(1, calls["runner"])
        print(f"  {steps} steps, {elapsed * 1e3 / steps:.2f} ms a step; synchronised ms a step:", flush=True)
        for key, total in sorted(ms.items(), key=lambda kv: -kv[1])[:24]:
            print(f"    {key:44s} {total / steps:7.2f} ms  {calls[key] / steps:6.1f} calls")
        runtime = llm.compiled.runtime
        executors = runtime.executors() if isinstance(runtime, PlanRuntime) else ()
        for name, executor in zip(("forward", "draft"), executors):
            graphs = None if executor is None else executor.cuda_graphs
            if graphs is not None:
                print(f"    {name} segments (every run of the mode): {graphs.replays} replayed, "
                      f"{graphs.captures} captured, {graphs.eager} eager over a bucket, {len(graphs.broken)} broken")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    depth = max((len(o.metrics.drafts_verified) for o in outs), default=0)
    verified, accepted = [0] * depth, [0] * depth
    for o in outs:
        for i, (v, a) in enumerate(zip(o.metrics.drafts_verified, o.metrics.drafts_accepted, strict=True)):
            verified[i] += v
            accepted[i] += a
    steps = verified[0] if verified else 0
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed, "captured": captured,
            "cold_tokens_per_s": tokens / cold if cold else None,
            "acceptance": [a / v for a, v in zip(accepted, verified, strict=True) if v],
            "tokens_per_step": (steps + sum(accepted)) / steps if steps else 1.0,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def paired_ratios(results: list[dict], batch: int, names: list[str]) -> None:
    """Print each mode's tokens/s over the best static length's (the highest median) in the same pass, median and
    range over the passes: the machine's drift over a call cancels in each ratio."""
    rows = [r for r in results if r["batch"] == batch]
    static = [n for n in names if n.startswith("static ")]
    if not static:
        return
    best = max(static, key=lambda n: statistics.median(r["tokens_per_s"] for r in rows if r["mode"] == n))
    base = {r["pass_index"]: r["tokens_per_s"] for r in rows if r["mode"] == best}
    for name in names:
        ratios = sorted(r["tokens_per_s"] / base[r["pass_index"]] for r in rows if r["mode"] == name)
        print(f"paired  {batch:3d}  {name:16s} {statistics.median(ratios):.3f}x {best}  "
              f"(passes {ratios[0]:.3f}-{ratios[-1]:.3f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-requests", type=int, default=8,
                    help="requests per run at least (a batch of 1 runs them one after another)")
    ap.add_argument("--budgets", default="1.5,2,3,4",
                    help="confidence budgets, tokens per step per request (4 verifies what static 3 does)")
    ap.add_argument("--confidence-drafts", default="5", help="drafts proposed per step under confidence scheduling")
    ap.add_argument("--device", default="cpu", help="where the cpu target's torch code runs (cuda: the H200)")
    ap.add_argument("--target", default="cpu", help="compile target (sm90: the Hopper kernels; --device is then moot)")
    ap.add_argument("--regex", default=None, help="constrain every request to this regex (structured outputs)")
    ap.add_argument("--modes", default=None, help="only these modes, comma-separated (e.g. 'off,static 2')")
    ap.add_argument("--profile", type=int, default=0, help="print the N functions of most own time of each timed run")
    ap.add_argument("--phases", nargs="?", const="engine", choices=["engine", "nodes"], default=None,
                    help="time the engine's phases of each timed run, synchronised (nodes: every node's op too)")
    ap.add_argument("--kernels", type=int, default=0, help="print the N kernels of most GPU time of each timed run")
    ap.add_argument("--warmups", type=int, default=2, help="untimed runs of the same requests first (the first: cold)")
    ap.add_argument("--passes", type=int, default=1,
                    help="run the modes this many times, every other pass in reverse order (a machine speeds up over "
                         "a call, which favours the later modes), and print each mode's median")
    ap.add_argument("--interleave", action="store_true",
                    help="build every mode's engine once, then time one run of each mode a pass (alternating order): "
                         "passes seconds apart, and each mode's ratio to the best static length per pass (paired)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.interleave and (args.profile or args.phases or args.kernels):
        ap.error("--interleave times plain runs: drop --profile, --phases and --kernels")
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = prompts_from_stdlib(max(batch, args.min_requests))
        modes: list[tuple[str, dict | None]] = [("off", None)]
        modes += [(f"static {n}", {"num_speculative_tokens": n, "schedule": "static"}) for n in range(1, 6)]
        for k in (int(d) for d in args.confidence_drafts.split(",")):
            for per_seq in (float(b) for b in args.budgets.split(",")):
                budget = max(batch + 1, round(per_seq * batch)) if batch > 1 else k + 1
                modes.append((f"confidence {k}/{budget}", {"num_speculative_tokens": k, "verify_budget": budget}))
                modes.append((f"conf-draft {k}/{budget}", {"num_speculative_tokens": k, "verify_budget": budget,
                                                           "confidence": "draft"}))
                modes.append((f"adaptive {k}/{budget}", {"num_speculative_tokens": k, "verify_budget": budget,
                                                         "draft_lengths": "adaptive"}))
                if batch == 1:
                    break
        if args.modes:
            modes = [m for m in modes if m[0] in args.modes.split(",")]
        reference = None
        where = {"device": args.device} if args.target == "cpu" else {"target": args.target}
        engines = {name: prepare_mode(args.model, spec, prompts, batch, args.max_tokens, where, args.regex,
                                      args.warmups) for name, spec in modes} if args.interleave else {}
        for index in range(args.passes):
            for name, spec in modes if index % 2 == 0 else modes[::-1]:
                if args.interleave:
                    r = timed_run(*engines[name][:2], prompts, engines[name][2] if index == 0 else 0.0)
                else:
                    r = run_mode(args.model, spec, prompts, batch, args.max_tokens, where, args.regex, args.profile,
                                 args.phases, args.kernels, args.warmups)
                outputs = r.pop("outputs")
                reference = reference or outputs
                r.update(batch=batch, mode=name, same_as_off=outputs == reference, pass_index=index)
                results.append(r)
                acc = " ".join(f"{a:.2f}" for a in r["acceptance"])
                cold = f"{r['cold_tokens_per_s']:6.1f}" if r["cold_tokens_per_s"] else "-"
                print(f"batch {batch:3d}  {name:16s} {r['tokens_per_s']:8.1f} tok/s (cold {cold:>6s})  "
                      f"{r['tokens_per_step']:.2f} tok/step"
                      f"  acceptance [{acc}]  same={r['same_as_off']}"
                      + (f"  (the timed run captured {r['captured']} graph segments)" if r["captured"] else ""),
                      flush=True)
        if args.passes > 1:
            for name, _ in modes:
                runs = sorted(r["tokens_per_s"] for r in results if r["batch"] == batch and r["mode"] == name)
                print(f"median  {batch:3d}  {name:16s} {statistics.median(runs):8.1f} tok/s  "
                      f"(passes: {' '.join(f'{v:.1f}' for v in runs)})", flush=True)
            paired_ratios(results, batch, [name for name, _ in modes])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
