"""End-to-end cost of structured outputs through `LLM.generate` on the embedded default model (cpu target).

Decode tokens/s of a batch without constraints, with every request under a regex that never ends within
`max_tokens` (so every step fills and applies masks), and with one request of the batch under it (the others' rows
stay open), with the mask fill overlapped with the forward and after it; then the unconstrained batch again at the
end of the process, which shows whether anything before it slowed the process down for good.

    python bench/structured_outputs_llm.py [--batch 16] [--tokens 32] [--runs 3] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepinfer import LLM, SamplingParams, StructuredOutputsParams


def tokens_per_s(llm: LLM, batch: int, tokens: int, num_constrained: int, runs: int) -> float:
    """Median decode tokens/s of `batch` requests, the first `num_constrained` of them under the regex."""
    constraint = StructuredOutputsParams(regex=r"[a-z ]{1,4000}")
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=constraint if i < num_constrained else None) for i in range(batch)]
    prompts = [f"request {i}:" for i in range(batch)]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm: grammar compiled, first steps done
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--record", action="store_true", help="append the line to bench/RESULTS.md")
    args = parser.parse_args()
    rate = {}
    for overlap in (True, False):
        llm = LLM(overlap_structured_outputs=overlap)
        if overlap:
            rate["none"] = tokens_per_s(llm, args.batch, args.tokens, 0, args.runs)
        for name, num_constrained in (("all", args.batch), ("one", 1)):
            rate[name, overlap] = tokens_per_s(llm, args.batch, args.tokens, num_constrained, args.runs)
    rate["none again"] = tokens_per_s(llm, args.batch, args.tokens, 0, args.runs)
    none = rate["none"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    line = (f"- {datetime.date.today()} {commit} structured outputs end to end (embedded default model, cpu, batch "
            f"{args.batch}, {args.tokens} tokens, median of {args.runs}): unconstrained {none:.1f} tokens/s; every "
            f"request under a regex, masks filled during the forward {rate['all', True]:.1f} "
            f"({rate['all', True] / none:.2f}x), after it {rate['all', False]:.1f} ({rate['all', False] / none:.2f}x); "
            f"one request of {args.batch} under it, during {rate['one', True]:.1f} ({rate['one', True] / none:.2f}x), "
            f"after {rate['one', False]:.1f} ({rate['one', False] / none:.2f}x); unconstrained again at the end of "
            f"the process {rate['none again']:.1f} ({rate['none again'] / none:.2f}x)")
    print(line)
    if args.record:
        with open(Path(__file__).parent / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write("\n" + line + "\n")


if __name__ == "__main__":
    main()
