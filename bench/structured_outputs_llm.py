"""End-to-end cost of structured outputs through `LLM.generate` on the embedded default model (cpu target).

Decode tokens/s of a batch without constraints, and with every request under a regex that never ends within
`max_tokens` (so every step fills and applies masks), with the mask fill overlapped with the forward and after it.

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

from deepinfer import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402


def tokens_per_s(llm: LLM, batch: int, tokens: int, constrained: bool, runs: int) -> float:
    constraint = StructuredOutputsParams(regex=r"[a-z ]{1,4000}") if constrained else None
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=tokens, ignore_eos=True,
                             structured_outputs=constraint) for i in range(batch)]
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
    rates = {}
    for overlap in (True, False):
        llm = LLM(overlap_structured_outputs=overlap)
        if overlap:
            rates["none"] = tokens_per_s(llm, args.batch, args.tokens, False, args.runs)
        rates["overlap" if overlap else "after"] = tokens_per_s(llm, args.batch, args.tokens, True, args.runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    line = (f"- {datetime.date.today()} {commit} structured outputs end to end (embedded default model, cpu, batch "
            f"{args.batch}, {args.tokens} tokens, regex on every request, median of {args.runs}): unconstrained "
            f"{rates['none']:.1f} tokens/s; constrained, masks filled during the forward {rates['overlap']:.1f} "
            f"({rates['overlap'] / rates['none']:.2f}x); filled after it {rates['after']:.1f} "
            f"({rates['after'] / rates['none']:.2f}x)")
    print(line)
    if args.record:
        with open(Path(__file__).parent / "RESULTS.md", "a", encoding="utf-8") as f:
            f.write("\n" + line + "\n")


if __name__ == "__main__":
    main()
