"""Structured outputs on the CPU at the full V4.1 vocabulary (129280): what a constraint costs per token.

Mask fill: a request's matcher walks a realistic completion (a JSON document under its schema, a log line under a
regex), tokenized by the V4 tokenizer; before each token its bitmask row is filled, and timed. Reported: the median
and p90 over every step of many passes, in µs per token per request. Also: applying a filled row to fp32 logits,
and filling a batch of 16 requests at once (xgrammar's threads), per request.

`--e2e` adds the end-to-end cost on the embedded default model (random weights, cpu target): decode tokens/s for a
batch without constraints, with constraints filled after the forward, and filled on the manager's thread while the
forward runs (the overlap).

    python bench/structured_outputs_bench.py [--passes 50] [--e2e] [--record]   (--record appends to RESULTS.md)
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepinfer.structured_outputs import StructuredOutputManager, StructuredOutputsParams
from deepinfer.structured_outputs.bitmask import allocate_bitmask, apply_bitmask
from deepinfer.tokenizer import load_tokenizer

VOCAB, EOS = 129280, 1
SCHEMA = {"type": "object", "required": ["name", "age", "email", "tags", "address", "status"], "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "required": ["city", "zip"], "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
    "status": {"enum": ["active", "inactive", "banned"]}}}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"],
                       "address": {"city": "London", "zip": "10001"}, "status": "active"})
REGEX = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z (INFO|WARN|ERROR) [a-z ]{1,60}"
LOG_LINE = "2024-05-17T12:30:45Z INFO server started on port eighty after a warm restart"
CASES = {"json schema": (StructuredOutputsParams(json=SCHEMA), DOCUMENT), "regex": (StructuredOutputsParams(regex=REGEX),
                                                                                   LOG_LINE)}


def fill_times(manager: StructuredOutputManager, params: StructuredOutputsParams, tokens: list[int],
               passes: int) -> list[float]:
    """µs of each fill along `tokens` (then eos), over `passes` passes of a fresh request."""
    bitmask = allocate_bitmask(1, VOCAB)
    times = []
    for i in range(passes):
        manager.add_request(f"r{i}", params)
        manager.is_ready(f"r{i}", wait=True)
        matcher = manager.matcher(f"r{i}")
        for token in [*tokens, EOS]:
            start = time.perf_counter()
            matcher.fill_bitmask(bitmask, 0)
            times.append((time.perf_counter() - start) * 1e6)
            assert matcher.accept(token), f"the grammar refuses token {token} of its own example"
        assert matcher.is_terminated()
        manager.remove_request(f"r{i}")
    return times


def batch_fill_us(manager: StructuredOutputManager, params: StructuredOutputsParams, tokens: list[int],
                  batch: int = 16) -> float:
    """Median µs per request of filling `batch` requests at once, each at a different point of the completion."""
    ids = [f"b{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        manager.add_request(request_id, params)
        manager.is_ready(request_id, wait=True)
        for token in tokens[: i * len(tokens) // batch]:
            manager.accept(request_id, token)
    times = []
    for _ in range(50):
        start = time.perf_counter()
        manager.fill_bitmask(ids)
        times.append((time.perf_counter() - start) * 1e6 / batch)
    for request_id in ids:
        manager.remove_request(request_id)
    return statistics.median(times)


def apply_us(device: str = "cpu", rows: int = 1) -> float:
    """Median µs per row to apply a realistic mask (a few allowed ids) to fp32 logits [rows, 129280] on `device`
    (on CUDA: xgrammar's Triton kernel, the bitmask copied from the CPU included)."""
    logits = torch.randn(rows, VOCAB, device=device)
    bitmask = allocate_bitmask(rows, VOCAB)
    bitmask.zero_()
    bitmask[:, :4] = -1
    times = []
    for _ in range(200):
        row = logits.clone()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        apply_bitmask(row, bitmask)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / rows)
    return statistics.median(times)


def e2e_tokens_per_s(manager: StructuredOutputManager, tokenizer, batch: int, steps: int) -> dict[str, float]:
    """Decode tokens/s of the default model: unconstrained ("none"), the next step's mask filled after the forward
    ("after"), and filled on the manager's thread while the forward runs ("overlap")."""
    import deepinfer
    from deepinfer.default_model import default_model

    compiled = deepinfer.compile(default_model(tokenizer=tokenizer), "cpu")
    params = StructuredOutputsParams(regex=r"[a-z ]{1,4000}")  # never ends within `steps`: every step constrained
    results = {}
    for mode in ("none", "after", "overlap"):
        ids = [f"{mode}{i}" for i in range(batch)]
        for request_id in ids:
            manager.add_request(request_id, params)
            manager.is_ready(request_id, wait=True)
        states = [compiled.new_sequence() for _ in ids]
        logits = compiled.step([(s, [0, 100]) for s in states])
        start = time.perf_counter()
        mask = manager.fill_bitmask(ids) if mode != "none" else None
        for _ in range(steps):
            if mask is not None:
                manager.apply_bitmask(logits, mask)
            tokens = logits.argmax(-1).tolist()
            for request_id, token in zip(ids, tokens):
                assert mode == "none" or manager.accept(request_id, token)
            future = manager.fill_bitmask_async(ids) if mode == "overlap" else None
            logits = compiled.step([(s, [t]) for s, t in zip(states, tokens)])
            if mode != "none":
                mask = future.result() if future is not None else manager.fill_bitmask(ids)
        results[mode] = batch * steps / (time.perf_counter() - start)
        for request_id in ids:
            manager.remove_request(request_id)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=50)
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--record", action="store_true", help="append one line to bench/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer()
    manager = StructuredOutputManager(tokenizer, VOCAB, [EOS])
    summary = []
    for name, (params, text) in CASES.items():
        tokens = tokenizer.encode(text)
        times = fill_times(manager, params, tokens, args.passes)
        median, p90 = statistics.median(times), statistics.quantiles(times, n=10)[-1]
        batched = batch_fill_us(manager, params, tokens)
        print(f"{name:12s} {len(tokens) + 1:3d} tokens x {args.passes} passes: fill median {median:7.1f} µs, "
              f"p90 {p90:7.1f} µs per token per request; batch of 16: {batched:6.1f} µs per request")
        summary.append(f"{name} {median:.1f} µs (p90 {p90:.1f}; batched x16 {batched:.1f}/req)")
    applied = apply_us()
    print(f"apply one row to fp32 logits [1, {VOCAB}]: {applied:.1f} µs")
    summary.append(f"apply {applied:.1f} µs/row")
    if torch.cuda.is_available():
        for rows in (1, 64):
            applied = apply_us("cuda", rows)
            print(f"apply on CUDA (xgrammar's Triton kernel), [{rows}, {VOCAB}]: {applied:.1f} µs per row")
            summary.append(f"apply on CUDA x{rows} {applied:.1f} µs/row")
    if args.e2e:
        rates = e2e_tokens_per_s(manager, tokenizer, batch=8, steps=16)
        print("decode tokens/s, default model on cpu, batch 8: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
        summary.append("e2e tok/s (default model, cpu, batch 8): " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    manager.shutdown()
    if args.record:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        line = (f"- {datetime.date.today()} {commit} structured outputs, mask fill per token per request (CPU, "
                f"vocab {VOCAB}, xgrammar 0.2.9, median over {args.passes} passes): " + "; ".join(summary) + "\n")
        results = Path(__file__).resolve().parent / "RESULTS.md"
        with open(results, "a", encoding="utf-8") as f:  # append: others write to this file too
            f.write(line)
        print(f"appended to {results}")


if __name__ == "__main__":
    main()
