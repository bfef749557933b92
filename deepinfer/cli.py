"""The `deepinfer` command: `deepinfer generate "prompt" ...` prints completions; `--input`/`--output` take JSONL."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

# CLI flag -> SamplingParams field, for the flags that are passed only when given.
_SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                   "ignore_eos", "logprobs")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Offline inference for DeepSeek-V4.1-Flash.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts and print the completions")
    gen.add_argument("prompts", nargs="*", help="prompts to complete (or give --input)")
    gen.add_argument("--model", default=None,
                     help="checkpoint directory (default: the embedded model, which has random weights)")
    gen.add_argument("--target", default="cpu", help="compile target: cpu, sm90, sm100 (default: cpu)")
    gen.add_argument("--max-model-len", type=int, default=None, help="bound on prompt plus completion tokens")
    gen.add_argument("--input", default=None, help='JSONL file of {"prompt": ...} or {"prompt_token_ids": [...]}')
    gen.add_argument("--output", default=None, help="write one JSON result per line here instead of printing")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    sampling = gen.add_argument_group("sampling (vLLM's meanings; SamplingParams' defaults)")
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--min-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None, help="0 or -1 = off")
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--n", type=int, default=None, help="completions per prompt")
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", default=None)
    sampling.add_argument("--logprobs", type=int, default=None, help="top log-probabilities per token")
    return parser


def read_prompts(path: str) -> list[str | dict[str, Any]]:
    """The prompts of a JSONL file: one object per line with "prompt" or "prompt_token_ids" (or a bare string)."""
    prompts: list[str | dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"deepinfer: {path}:{number}: not JSON: {e}") from None
            if not isinstance(item, (str, dict)):
                raise SystemExit(f"deepinfer: {path}:{number}: expected an object or a string")
            prompts.append(item)
    return prompts


def to_json(out: RequestOutput) -> dict[str, Any]:
    """One result as a JSON-ready dict."""
    return {"request_id": out.request_id, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
            "seed": out.seed, "error": out.error,
            "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                         "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                         "cumulative_logprob": c.cumulative_logprob} for c in out.outputs]}


def print_result(out: RequestOutput) -> None:
    prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
    print(f"Prompt: {prompt!r}")
    if out.error is not None:
        print(f"Error: {out.error}")
    for c in out.outputs if out.error is None else []:
        label = "Completion" if len(out.outputs) == 1 else f"Completion {c.index}"
        print(f"{label}: {c.text!r}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    print()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (1 when a request failed)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="deepinfer: %(levelname)s: %(message)s", stream=sys.stderr)
    prompts: list[str | dict[str, Any]] = list(args.prompts)
    if args.input:
        prompts += read_prompts(args.input)
    if not prompts:
        raise SystemExit("deepinfer generate: give prompts, or --input FILE")
    try:
        params = SamplingParams(**{k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None})
    except ValueError as e:
        raise SystemExit(f"deepinfer generate: {e}") from None

    from deepinfer.llm import LLM  # after argument checks: loading the model takes seconds

    llm = LLM(args.model, target=args.target, max_model_len=args.max_model_len)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(to_json(out), ensure_ascii=False) + "\n" for out in outputs)
    else:
        for out in outputs:
            print_result(out)
    generated = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    print(f"deepinfer: {len(outputs)} requests, {generated} tokens generated in {elapsed:.2f} s "
          f"({generated / elapsed:.1f} tokens/s)", file=sys.stderr)
    return 1 if any(out.error is not None for out in outputs) else 0
