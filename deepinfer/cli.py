"""The `deepinfer` command.

`deepinfer generate "prompt" ...` prints completions; with `--input prompts.jsonl --output results.jsonl` it writes
one line per finished request and resumes where a killed run stopped (deepinfer/results_file.py).
`deepinfer bench` measures throughput on synthetic prompts and prints a table (deepinfer/benchmark.py).
`deepinfer autotune` tunes the kernels of a config on this GPU (deepinfer/autotune_cli.py).
An ordinary mistake (a missing file or model folder, a target without its GPU, a bad flag value) ends the command
with one line naming it and exit status 1, never a traceback.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from typing import Any

from deepinfer.config import ConfigError
from deepinfer.outputs import Logprob, RequestOutput
from deepinfer.results_file import InputLine, ResultsFile, read_inputs
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured_outputs.params import StructuredOutputsParams
from kernels.targets import DEFAULT_TARGET, built_targets

# CLI flag -> SamplingParams field, for the flags that are passed only when given.
_SAMPLING_FLAGS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
                   "ignore_eos", "logprobs")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that build the LLM: model, target and engine arguments."""
    parser.add_argument("--model", default=None,
                        help="checkpoint directory (default: the embedded model, a tiny V4.1-Flash trained on the "
                             "Python standard library)")
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"compile target: {', '.join(t.name for t in built_targets())} "
                             f"(default: {DEFAULT_TARGET})")
    parser.add_argument("--fp8-activations", action="store_true",
                        help="GPU targets: e4m3 inputs for the fp8-weight linears (faster prefill, not exact)")
    parser.add_argument("--device", default="cpu",
                        help="where the cpu target's torch code runs: cpu, or cuda (each rank its own GPU)")
    engine = parser.add_argument_group("engine (EngineArgs; defaults as there)")
    engine.add_argument("--max-model-len", type=int, default=None, help="bound on prompt plus completion tokens")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="sequences running at once")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per forward")
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="cache budget in bytes")
    engine.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="GPU targets: share of the memory left after the weights that the caches take (0.9)")
    engine.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None)
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                        help="share and keep the blocks of prompts that start alike (on by default)")
    engine.add_argument("--expert-parallel-size", type=int, default=None,
                        help="ranks the routed experts are split over, each running a share of the requests "
                             "(default: torchrun's WORLD_SIZE, else 1)")
    engine.add_argument("--engram-storage", choices=("host", "device"), default=None,
                        help="where the Engram tables live (default: host when they do not fit the device)")
    engine.add_argument("--swa-replay-tokens", type=int, default=None, metavar="K",
                        help="bounded replay: prefill the decoder layers from each prompt's last K tokens on only "
                             "(an approximation; off by default; DeepSeek uses 140)")
    drafting = engine.add_mutually_exclusive_group()
    drafting.add_argument("--dspark", type=int, default=None, metavar="K",
                          help="DSpark drafting with the model's draft layers, K drafts per step (off by default)")
    drafting.add_argument("--speculative-config", default=None, metavar="JSON",
                          help='DSpark settings as LLM(speculative_config=...), e.g. \'{"method": "dspark", '
                               '"num_speculative_tokens": 3, "schedule": "static"}\'')


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes",
             "gpu_memory_utilization", "async_scheduling", "batch_invariant", "enable_prefix_caching",
             "expert_parallel_size", "engram_storage", "swa_replay_tokens")
    return {k: getattr(args, k) for k in names if getattr(args, k) is not None}


def llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM's keyword arguments from the engine flags (`add_engine_flags`)."""
    kwargs = {"model": args.model, "target": args.target, "fp8_activations": args.fp8_activations,
              **engine_kwargs(args)}
    if args.device != "cpu":
        kwargs["device"] = args.device
    if args.dspark is not None:
        kwargs["speculative_config"] = {"method": "dspark", "num_speculative_tokens": args.dspark}
    elif args.speculative_config is not None:
        try:
            kwargs["speculative_config"] = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"deepinfer: --speculative-config is not JSON: {e}") from None
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Offline inference for DeepSeek-V4.1-Flash.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete prompts and print the completions")
    gen.add_argument("prompts", nargs="*", help="prompts to complete (or give --input)")
    add_engine_flags(gen)
    gen.add_argument("--input", default=None,
                     help='JSONL file: {"id", "prompt" or "prompt_token_ids", sampling fields} per line')
    gen.add_argument("--output", default=None, help="append one JSON result per line here (resumable) instead of "
                                                    "printing")
    gen.add_argument("--no-progress", action="store_true", help="no progress bar")
    sampling = gen.add_argument_group("sampling (vLLM's meanings; SamplingParams' defaults; a JSONL line's own win)")
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--min-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 1.0)")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None, help="0 or -1 = off")
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--seed", type=int, default=None, help="default: each request's own, from its id")
    sampling.add_argument("--n", type=int, default=None, help="completions per prompt")
    sampling.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    sampling.add_argument("--ignore-eos", action="store_true", default=None)
    sampling.add_argument("--logprobs", type=int, default=None,
                          help="top log-probabilities per generated token, written into each --output record "
                               "(-1: the whole vocabulary)")
    constrain = gen.add_argument_group("structured outputs (one at most; a JSONL line's own constraint wins)")
    constrain.add_argument("--json-schema", default=None, help="a JSON schema, inline or @file")
    constrain.add_argument("--regex", default=None, help="a regular expression the completion must match")
    constrain.add_argument("--grammar", default=None, help="an EBNF grammar (xgrammar's GBNF), inline or @file")
    constrain.add_argument("--choice", action="append", default=None, help="an allowed completion (repeatable)")
    from deepinfer.benchmark import add_bench_parser

    add_bench_parser(commands)
    from deepinfer.autotune_cli import add_autotune_parser

    add_autotune_parser(commands)
    return parser


def id_seed(line_id: Any) -> int:
    """A request's seed from its id, so a resumed run samples what an uninterrupted one would have."""
    return int.from_bytes(hashlib.blake2b(json.dumps(line_id).encode(), digest_size=8).digest(), "little") >> 1


def _logprobs_json(steps: list[dict[int, Logprob] | None] | None) -> list | None:
    """Per token, its candidates in order (the sampled or prompt token first, as vLLM), as JSON objects."""
    if steps is None:
        return None
    return [None if step is None else [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank,
                                        "decoded_token": lp.decoded_token} for t, lp in step.items()]
            for step in steps]


def to_json(out: RequestOutput) -> dict[str, Any]:
    """One result as a JSON-ready dict; log-probabilities only when they were asked for."""
    record = {"request_id": out.request_id, "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
              "seed": out.seed, "error": out.error, "outputs": []}
    if getattr(out, "prompt_logprobs", None) is not None:
        record["prompt_logprobs"] = _logprobs_json(out.prompt_logprobs)
    for c in out.outputs:
        completion = {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob}
        if c.logprobs is not None:
            completion["logprobs"] = _logprobs_json(c.logprobs)
        record["outputs"].append(completion)
    return record


def print_result(out: RequestOutput) -> None:
    prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
    print(f"Prompt: {prompt!r}")
    if out.error is not None:
        print(f"Error: {out.error}")
    for c in out.outputs if out.error is None else []:
        label = "Completion" if len(out.outputs) == 1 else f"Completion {c.index}"
        print(f"{label}: {c.text!r}  ({len(c.token_ids)} tokens, {c.finish_reason})")
    print()


def _params(line: InputLine, flags: dict[str, Any]) -> SamplingParams:
    fields = {**flags, **line.sampling}
    fields.setdefault("seed", id_seed(line.id))
    if isinstance(fields.get("structured_outputs"), dict):
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return SamplingParams(**fields)


def _constraint_flags(args: argparse.Namespace) -> dict[str, Any] | None:
    """The constraint given as flags, as StructuredOutputsParams fields; `@path` reads a schema or grammar file."""
    given = {"json": args.json_schema, "regex": args.regex, "grammar": args.grammar, "choice": args.choice}
    given = {k: v for k, v in given.items() if v is not None}
    for key in ("json", "grammar"):
        if isinstance(given.get(key), str) and given[key].startswith("@"):
            with open(given[key][1:], encoding="utf-8") as f:
                given[key] = f.read()
    return given or None


def _requests(args: argparse.Namespace) -> tuple[list, list[dict[str, Any]]]:
    """(line, SamplingParams) of every request still to run, and error records for lines that cannot run."""
    lines = [InputLine(f"arg{i}", prompt, {}) for i, prompt in enumerate(args.prompts, start=1)]
    if args.input:
        lines += read_inputs(args.input)
    if not lines:
        raise SystemExit("deepinfer generate: give prompts, or --input FILE")
    flags = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k) is not None}
    try:
        if (constraint := _constraint_flags(args)) is not None:
            flags["structured_outputs"] = constraint
        _params(InputLine("flags", "", {}), flags)
    except (ValueError, OSError) as e:
        raise SystemExit(f"deepinfer generate: {e}") from None
    todo, failed = [], []
    for line in lines:
        try:
            if line.error is not None:
                raise ValueError(line.error)
            todo.append((line, _params(line, flags)))
        except (ValueError, TypeError) as e:  # a bad line fails alone
            error = str(e) if line.error is not None else f"bad sampling fields: {e}"
            failed.append({"id": line.id, "prompt": line.prompt or None, "error": error, "outputs": []})
    return todo, failed


def _check_paths(args: argparse.Namespace) -> None:
    """The input must exist and differ from the output (a run would read the results it writes)."""
    if args.input is None:
        return
    if not os.path.isfile(args.input):
        raise SystemExit(f"deepinfer generate: --input {args.input}: no such file")
    if args.output is not None and os.path.exists(args.output) and os.path.samefile(args.input, args.output):
        raise SystemExit(f"deepinfer generate: --input and --output are the same file ({args.output}); the "
                         "results go to a file of their own")


def _run(args: argparse.Namespace, todo: list, results: ResultsFile | None) -> tuple[dict[int, RequestOutput], float]:
    """Build the LLM and run every request, writing each result to `results` as it finishes; the outputs by index,
    and the seconds the requests took (loading not counted)."""
    from deepinfer.llm import LLM  # after argument checks: loading the model takes seconds

    try:
        llm = LLM(**llm_kwargs(args))
    except BaseException:
        if results is not None:
            results.abandon()  # a failed start leaves no empty file behind
        raise
    start, outputs = time.perf_counter(), {}
    for index, out in llm.iter_generate([line.prompt for line, _ in todo], [p for _, p in todo],
                                        use_tqdm=not args.no_progress):
        outputs[index] = out
        if results is not None:
            results.write({"id": todo[index][0].id, **to_json(out)})
    return outputs, time.perf_counter() - start


def _torchrun_rank(args: argparse.Namespace) -> int:
    """Under torchrun, join the ranks (expert parallelism over WORLD_SIZE unless --expert-parallel-size says) and
    return this one; else 0. Every rank runs every request with the others; rank 0 alone prints and writes."""
    from deepinfer.distributed import ranks

    if not ranks.started_by_torchrun():
        return 0
    info = ranks.join(ranks.from_torchrun(), args.device)
    if args.expert_parallel_size is None:
        args.expert_parallel_size = info.world_size
    return info.rank


def _skip_done(todo: list, failed: list[dict[str, Any]], done: set) -> tuple[list, list[dict[str, Any]]]:
    """The requests and failed lines an earlier run has not finished (on every rank: rank 0's file's ids)."""
    from deepinfer.distributed import ranks

    if ranks.current() is not None:
        import torch.distributed as dist

        shared = [done]
        dist.broadcast_object_list(shared, src=0)
        done = shared[0]
    return [(line, p) for line, p in todo if line.id not in done], [r for r in failed if r["id"] not in done]


def generate(args: argparse.Namespace) -> int:
    """`deepinfer generate`: print the completions, or append them to --output as they finish."""
    _check_paths(args)
    rank = _torchrun_rank(args)
    todo, failed = _requests(args)
    results = ResultsFile(args.output) if args.output and rank == 0 else None
    todo, failed = _skip_done(todo, failed, results.done if results is not None else set())
    if results is not None:
        for record in failed:
            results.write(record)
    outputs, elapsed = _run(args, todo, results) if todo else ({}, 0.0)
    if rank != 0:
        return 0
    if results is None:
        for record in failed:
            print(f"Prompt: {record['prompt']!r}\nError: {record['error']}\n")
        for index in range(len(todo)):
            print_result(outputs[index])
    else:
        results.close()
    generated = sum(len(c.token_ids) for out in outputs.values() for c in out.outputs)
    print(f"deepinfer: {len(outputs)} requests, {generated} tokens generated in {elapsed:.2f} s "
          f"({generated / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 1 if failed or any(out.error is not None for out in outputs.values()) else 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (1 when a request failed or the command could not start)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="deepinfer: %(levelname)s: %(message)s", stream=sys.stderr)
    logging.getLogger("deepinfer.llm").setLevel(logging.INFO)  # the model line: which model, its size, the target
    try:
        if args.command == "bench":
            from deepinfer.benchmark import bench

            return bench(args)
        if args.command == "autotune":
            from deepinfer.autotune_cli import autotune

            return autotune(args)
        return generate(args)
    except (ConfigError, ValueError, NotImplementedError, OSError) as e:
        raise SystemExit(f"deepinfer: error: {e}") from None
    except RuntimeError as e:
        from deepinfer.llm import DeviceUnavailableError

        if isinstance(e, DeviceUnavailableError):
            raise SystemExit(f"deepinfer: error: {e}") from None
        raise
    finally:
        from deepinfer.distributed import ranks

        ranks.leave()  # a rank leaves its group before exiting (gloo's threads must not outlive the interpreter)
