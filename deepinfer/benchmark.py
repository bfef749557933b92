"""`deepinfer bench`: generation throughput on synthetic prompts, over a grid of batch sizes and engine settings.

Each configuration runs once untimed, then `--repeat` times, on one compiled model (a fresh engine each run); the
table shows medians.
Prompts are random token ids of `--input-len` tokens; every request generates exactly `--output-len` tokens
(ignore_eos), sampled at `--temperature` with a seed per request.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.sampling_params import SamplingParams

_ON_OFF = {"on": True, "off": False}


def add_bench_parser(commands) -> None:
    from deepinfer.cli import add_engine_flags

    bench = commands.add_parser("bench", help="measure throughput on synthetic prompts and print a table")
    add_engine_flags(bench)
    bench.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="requests per run (default: 1 16)")
    bench.add_argument("--input-len", type=int, default=32, help="prompt tokens (default 32)")
    bench.add_argument("--output-len", type=int, default=32, help="generated tokens per request (default 32)")
    bench.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    bench.add_argument("--async", dest="async_grid", nargs="+", choices=_ON_OFF, default=None,
                       help="asynchronous scheduling settings to compare (default: the engine's)")
    bench.add_argument("--invariant", dest="invariant_grid", nargs="+", choices=_ON_OFF, default=None,
                       help="batch-invariant settings to compare (default: the engine's)")
    bench.add_argument("--repeat", type=int, default=3, help="runs per configuration; the median is shown")


def run_once(llm, args: EngineArgs, batch: int, input_len: int, output_len: int, temperature: float) -> dict:
    """One run of `batch` requests on a fresh engine; its timings."""
    engine = LLMEngine(llm.compiled, llm.tokenizer, args, llm.eos_token_ids)
    gen = torch.Generator().manual_seed(0)
    vocab = llm.config.vocab_size
    for i in range(batch):
        prompt = {"prompt_token_ids": torch.randint(0, vocab, (input_len,), generator=gen).tolist()}
        engine.add_request(prompt, SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True,
                                                  seed=i))
    start = time.perf_counter()
    outputs = list(engine.run())
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    ttft = statistics.median(out.metrics.time_to_first_token for out in outputs)
    return {"elapsed": elapsed, "tokens": tokens, "tok_s": tokens / elapsed, "ttft": ttft, "steps": engine.num_steps}


def bench(args: argparse.Namespace) -> int:
    """Run the grid and print one row per configuration. Runs go round the grid `--repeat` times, so a load that
    comes and goes (a shared machine) weighs on every configuration alike."""
    from deepinfer.cli import llm_kwargs
    from deepinfer.llm import LLM

    llm = LLM(**llm_kwargs(args))
    base = llm.engine_args
    asyncs = [_ON_OFF[a] for a in args.async_grid] if args.async_grid else [base.async_scheduling]
    invariants = [_ON_OFF[b] for b in args.invariant_grid] if args.invariant_grid else [base.batch_invariant]
    grid = list(itertools.product(args.batch, asyncs, invariants))
    engine_args = {(batch, a, i): EngineArgs(**{**base.__dict__, "async_scheduling": a, "batch_invariant": i,
                                                "max_num_seqs": max(base.max_num_seqs, batch)}) for batch, a, i in grid}
    for batch, is_async, invariant in grid:  # warm-up, not timed
        run_once(llm, engine_args[batch, is_async, invariant], batch, args.input_len, 2, args.temperature)
    runs: dict[tuple, list[dict]] = {key: [] for key in grid}
    for _ in range(args.repeat):
        for key in grid:
            runs[key].append(run_once(llm, engine_args[key], key[0], args.input_len, args.output_len, args.temperature))
    header = f"{'batch':>5} {'async':>5} {'invariant':>9} {'in':>4} {'out':>4} {'tokens/s':>9} {'TTFT ms':>8} " \
             f"{'steps':>5} {'runs':>4}"
    print(header)
    print("-" * len(header))
    for (batch, is_async, invariant), done in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in done)
        ttft = statistics.median(r["ttft"] for r in done) * 1000
        print(f"{batch:>5} {'on' if is_async else 'off':>5} {'on' if invariant else 'off':>9} {args.input_len:>4} "
              f"{args.output_len:>4} {tok_s:>9.1f} {ttft:>8.0f} {done[0]['steps']:>5} {len(done):>4}")
    return 0
