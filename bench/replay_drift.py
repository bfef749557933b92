"""Bounded replay (`swa_replay_tokens`) against the exact prefill on the embedded checkpoint, on the cpu target: how
far it drifts (first-token logits, greedy tokens, DSpark acceptance) and how much prefill time it saves.

Prompts are the first L tokens of standard library files the checkpoint held out of its training
(train/corpus.py), so the text is not memorised. Per prompt length L:
- first-token logits: relative L2 of the replayed prompt's last-row logits against the exact ones;
- greedy agreement: of `--max-tokens` greedy tokens, how many match the exact run's at the same position, and how
  many come before the first that differs;
- DSpark acceptance (`--dspark K` drafts): the share of verified drafts accepted, exact against replay.
Then, separately (`--time`), the prefill of one `--time-tokens` prompt timed exact and replayed (median of 3).

    python bench/replay_drift.py [--lengths 512,1024,2048,4096] [--prompts 2] [--keep 140] [--max-tokens 128]
                                 [--dspark 5] [--time] [--out replay.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepinfer
from deepinfer.cpu_threads import choose_cpu_threads, cpu_threads
from deepinfer.default_model import trained_model
from deepinfer.sampling_params import SamplingParams
from train.corpus import documents


def held_out_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: the starts of held-out standard library files long enough, in order."""
    out = []
    for _, text in documents("heldout"):
        ids = tokenizer.encode(text)
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} held-out files have {length} tokens")


def first_token_drift(exact, replay, prompts: list[list[int]], keep: int) -> list[float]:
    """Per prompt, relative L2 of the replayed last-row logits against the exact ones (batch-invariant mode)."""
    drifts = []
    for ids in prompts:
        a = exact.step([(exact.new_sequence(), ids)], batch_invariant=True)
        state = replay.new_sequence()
        state.replay_from = max(0, len(ids) - keep)
        b = replay.step([(state, ids)], batch_invariant=True)
        drifts.append(float((b - a).norm() / a.norm()))
    return drifts


def generate(prompts: list[list[int]], max_tokens: int, keep: int | None, dspark: int) -> list:
    speculative = {"method": "dspark", "num_speculative_tokens": dspark} if dspark else None
    llm = deepinfer.LLM(max_num_seqs=len(prompts), swa_replay_tokens=keep, speculative_config=speculative,
                        max_model_len=max(len(p) for p in prompts) + max_tokens + 8)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def agreement(exact: list, replay: list) -> list[tuple[int, int]]:
    """Per prompt: (tokens equal at the same position, tokens before the first that differs)."""
    out = []
    for a, b in zip(exact, replay, strict=True):
        x, y = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = [p == q for p, q in zip(x, y, strict=True)]
        out.append((sum(same), same.index(False) if False in same else len(same)))
    return out


def acceptance(outputs: list) -> float:
    verified = sum(sum(o.metrics.drafts_verified) for o in outputs)
    return sum(sum(o.metrics.drafts_accepted) for o in outputs) / verified if verified else 0.0


def prefill_ms(compiled, ids: list[int], keep: int | None) -> float:
    """Median ms of 3 prefills of `ids` on fresh sequences, after one untimed."""
    times = []
    for _ in range(4):
        state = compiled.new_sequence()
        state.replay_from = max(0, len(ids) - keep) if keep else 0
        start = time.perf_counter()
        compiled.step([(state, ids)], batch_invariant=True)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="512,1024,2048,4096")
    p.add_argument("--prompts", type=int, default=2, help="prompts per length")
    p.add_argument("--keep", type=int, default=140, help="swa_replay_tokens")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dspark", type=int, default=5, help="drafts per step for the acceptance runs (0: skip them)")
    p.add_argument("--time", action="store_true", help="also time the prefill of one --time-tokens prompt")
    p.add_argument("--time-tokens", type=int, default=2048)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    threads, about = choose_cpu_threads()
    model = trained_model()
    with cpu_threads(threads):
        exact, replay = deepinfer.compile(model), deepinfer.compile(model, replay=True)
    print(f"embedded checkpoint, keep {args.keep}, cpu target, {about}; torch {torch.__version__}", flush=True)
    rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        prompts = held_out_prompts(model.tokenizer, args.prompts, length)
        with cpu_threads(threads):
            drift = first_token_drift(exact, replay, prompts, args.keep)
        agree = agreement(generate(prompts, args.max_tokens, None, 0), generate(prompts, args.max_tokens, args.keep, 0))
        row = {"tokens": length, "first_token_rel_l2": drift, "greedy_same": [a for a, _ in agree],
               "greedy_prefix": [b for _, b in agree], "max_tokens": args.max_tokens}
        if args.dspark:
            row["dspark_acceptance"] = {name: acceptance(generate(prompts, args.max_tokens, keep, args.dspark))
                                        for name, keep in (("exact", None), ("replay", args.keep))}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.time:
        ids = held_out_prompts(model.tokenizer, 1, args.time_tokens)[0]
        with cpu_threads(threads):
            timing = {"tokens": args.time_tokens, "exact_ms": prefill_ms(exact, ids, None),
                      "replay_ms": prefill_ms(replay, ids, args.keep)}
        rows.append(timing)
        print(json.dumps(timing), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
