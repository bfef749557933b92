"""Seeded sampling at temperature 0.8 on the trained checkpoint: the engine drawing a step's plain-sampled rows at once
(`sampler.sample_plain`: on a GPU the sampling kernel, kernels/sampling/gumbel_argmax.py) against the same in torch
(`sample_plain_torch`, GPU targets only) and against one `sample` call a row, alternating, same outputs asserted.

    python bench/sampling_bench.py [--target cpu | sm90] [--batches 16,64] [--max-tokens 48] [--passes 4] [--dspark]

Prints, per batch and way, the median seconds of `passes` generate calls (one warm-up first) and tokens/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepinfer.engine.sampler as engine_sampler  # noqa: E402
import deepinfer.engine.spec_decode.drafter as drafter  # noqa: E402
from deepinfer import sampler  # noqa: E402
from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.default_model import trained_model  # noqa: E402


def use(plain_sampled, sample_plain) -> None:
    """The engine's sampler and the drafter judge rows with `plain_sampled` and draw them with `sample_plain`."""
    for module in (engine_sampler, drafter):
        module.plain_sampled, module.sample_plain = plain_sampled, sample_plain


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="cpu")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--dspark", action="store_true", help="with DSpark drafting, static length 3")
    args = p.parse_args()
    batched, at_once = sampler.plain_sampled, sampler.sample_plain
    spec = {"num_speculative_tokens": 3, "schedule": "static"} if args.dspark else None
    for batch in (int(b) for b in args.batches.split(",")):
        llm = LLM(trained_model(), target=args.target, max_num_seqs=batch, speculative_config=spec)
        prompts = [f"def f{i}(x):\n" for i in range(batch)]
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=1, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        ways = ["at once", "at once (torch)", "a row each"] if args.target != "cpu" else ["at once", "a row each"]
        times: dict[str, list[float]] = {way: [] for way in ways}
        outputs = {}
        try:
            for i in range(args.passes):
                for way in (list(times) if i % 2 == 0 else list(times)[::-1]):
                    use(batched if way != "a row each" else (lambda *a: False),
                        sampler.sample_plain_torch if way == "at once (torch)" else at_once)
                    start = time.perf_counter()
                    out = llm.generate(prompts, params, use_tqdm=False)
                    times[way].append(time.perf_counter() - start)
                    outputs[way] = [o.outputs[0].token_ids for o in out]
        finally:
            use(batched, at_once)
        assert all(outputs[way] == outputs["a row each"] for way in ways), "the ways sampled different tokens"
        tokens = batch * args.max_tokens
        for way, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{args.target} batch {batch} {way}: {median:.3f} s for {tokens} tokens, {tokens / median:.0f} tok/s "
                  f"(passes {', '.join(f'{s:.3f}' for s in seconds)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
