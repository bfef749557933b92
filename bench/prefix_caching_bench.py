"""Prefix caching on a shared prefix: time to first token and throughput, cached against not; hit rate; what a
snapshot costs (bytes, time to take and to restore one).

    python bench/prefix_caching_bench.py                      # cpu: 64 requests sharing a 2,000-token prefix
    python bench/prefix_caching_bench.py --target sm90        # the H200
    python bench/prefix_caching_bench.py --swa-replay-tokens 140   # both modes with bounded replay

Every request is the same `--prefix` random tokens (seeded) then its own `--suffix` tokens, `--max-tokens` greedy
tokens each, all submitted at once to one `LLM` (embedded checkpoint) with `enable_prefix_caching` off and on, the
same engine settings otherwise (`--swa-replay-tokens`: bounded replay in both); each mode is warmed up on a short
batch first. Time to first token is each request's first_token_time - arrival_time (all arrive at the start). The
outputs of the two modes are compared token for token.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import deepinfer
from deepinfer import LLM, SamplingParams


def _requests(args: argparse.Namespace, vocab_size: int) -> list[dict]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(vocab_size) for _ in range(args.prefix)]
    return [{"prompt_token_ids": prefix + [rng.randrange(vocab_size) for _ in range(args.suffix)]}
            for _ in range(args.num_requests)]


def _copy_us(llm: LLM, repeat: int = 50) -> tuple[float, float]:
    """Median µs of a snapshot's take (slot -> snapshot slot) and restore (snapshot slot -> slot), on the pools."""
    cache, layout = llm.engine.runner.cache, llm.engine.layout
    snapshot = layout.num_slots  # the first snapshot slot
    times = {"take": [], "restore": []}
    for _ in range(repeat):
        for name, (src, dst) in (("take", (0, snapshot)), ("restore", (snapshot, 1))):
            if cache.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            cache.copy_slot(src, dst)
            if cache.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) * 1e6)
    return statistics.median(times["take"]), statistics.median(times["restore"])


def run(args: argparse.Namespace, enable: bool) -> tuple[list, dict]:
    llm = LLM(deepinfer.default_checkpoint(), target=args.target, enable_prefix_caching=enable,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              swa_replay_tokens=args.swa_replay_tokens)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": list(range(100, 200))}] * 2, params, use_tqdm=False)  # warm-up
    if llm.engine.prefix_cache is not None:  # the hit rate of the timed batch alone
        llm.engine.prefix_cache.num_queried_tokens = llm.engine.prefix_cache.num_hit_tokens = 0
    requests = _requests(args, llm.compiled.config.vocab_size)
    start = time.perf_counter()
    outs = llm.generate(requests, params, use_tqdm=False)
    errors = [o.error for o in outs if o.error is not None]
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    wall = time.perf_counter() - start
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    figures = {"wall_s": wall, "ttft_mean_s": statistics.mean(ttft), "ttft_median_s": statistics.median(ttft),
               "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))], "output_tok_s": generated / wall,
               "requests_s": len(outs) / wall, "steps": llm.engine.num_steps}
    if enable:
        cache = llm.engine.prefix_cache
        take, restore = _copy_us(llm)
        layout = llm.engine.layout
        figures.update(hit_rate=cache.hit_rate, cached_tokens=sorted({o.num_cached_tokens for o in outs}),
                       snapshot_bytes=layout.slot_bytes, snapshot_interval=layout.snapshot_interval,
                       block_bytes=layout.block_bytes, take_us=take, restore_us=restore)
    return [o.outputs[0].token_ids for o in outs], figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cpu")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--suffix", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--swa-replay-tokens", type=int, default=None, help="bounded replay (None: exact prefill)")
    args = parser.parse_args()
    tokens = {}
    for enable in (False, True):
        tokens[enable], figures = run(args, enable)
        print(f"enable_prefix_caching={enable}: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items()), flush=True)
    print(f"same tokens: {tokens[False] == tokens[True]}")


if __name__ == "__main__":
    main()
