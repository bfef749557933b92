"""Where a GPU target's batch-invariant mode stops holding: one sequence's decode tokens fed one per step and in
chunks (as DSpark verification feeds them), every graph node's rows of the same tokens compared.

    python bench/invariance_probe.py [--model DIR] [--target sm90] [--prompt-tokens 60] [--decode 16] [--chunk 4]

The prompt goes in one chunk either way; then the same `--decode` tokens are fed one per step, and `--chunk` per
step. For each node whose output is a tensor over the forward's tokens, the largest difference over the decode
tokens' rows is printed, in graph order, from the first node that differs; the logits' verdict comes last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import deepinfer  # noqa: E402
from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.context import ForwardContext, SequenceState  # noqa: E402
from kernels.launch import use_launcher  # noqa: E402

DEFAULT_MODEL = ROOT / "deepinfer" / "checkpoints" / "v41-tiny-stdlib"


def feed(compiled, prompt: list[int], decode: list[int], chunk: int) -> dict[tuple[int, int], list[torch.Tensor]]:
    """Per (node index, output), the rows of the decode tokens (in order) of every output over the tokens."""
    executor, _ = compiled.runtime.executors()
    state, rows = SequenceState(), {}
    pieces = [prompt] + [decode[i:i + chunk] for i in range(0, len(decode), chunk)]
    for n, tokens in enumerate(pieces):
        ctx = ForwardContext([state], [len(tokens)], device="cuda")
        ids = torch.tensor(tokens, device="cuda")

        def trace(index: int, outputs: tuple, keep: bool = n > 0, count: int = len(tokens)) -> None:
            for j, out in enumerate(outputs):
                if keep and isinstance(out, torch.Tensor) and out.dim() and out.shape[0] == count:
                    rows.setdefault((index, j), []).extend(out.detach().float().cpu().unbind(0))

        with torch.inference_mode(), use_launcher(compiled.runtime.launcher):
            executor.run({"input_ids": ids}, ctx, True, trace)
        ctx.commit()
    return rows


def row_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Largest difference of two rows of one token; rows over a cache of the batch's width (the indexer's scores)
    are compared over the width they share. None if they cannot be compared."""
    if a.shape[1:] != b.shape[1:] or a.dim() != b.dim():
        return None
    width = min(a.shape[0], b.shape[0]) if a.dim() else None
    a, b = (a[:width], b[:width]) if width is not None else (a, b)
    equal = (a == b) | (a.isnan() & b.isnan())
    return 0.0 if bool(equal.all()) else float((a - b).abs().nan_to_num(float("inf")).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--prompt-tokens", type=int, default=60)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=4)
    args = ap.parse_args()
    model = DeepseekV41Flash.from_pretrained(args.model)
    compiled = deepinfer.compile(model, args.target)
    vocab = model.config.vocab_size
    ids = torch.randint(4, vocab, (args.prompt_tokens + args.decode,), generator=torch.Generator().manual_seed(0))
    prompt, decode = ids[: args.prompt_tokens].tolist(), ids[args.prompt_tokens:].tolist()
    one, chunked = feed(compiled, prompt, decode, 1), feed(compiled, prompt, decode, args.chunk)
    shown, differing = 0, 0
    for key in sorted(one):
        diffs = [row_diff(a, b) for a, b in zip(one[key], chunked.get(key, []))]
        bad = [t for t, d in enumerate(diffs) if d]
        if not bad:
            continue
        differing += 1
        if shown < 25:
            node = compiled.graph.nodes[key[0]]
            template = compiled.runtime.plan.nodes[key[0]].template or "reference"
            print(f"node {key[0]:4d} {node.op:24s} ({template}) out {key[1]}: max diff {max(diffs[t] for t in bad):.3e}"
                  f" at decode tokens {bad[:8]}")
            shown += 1
    print(f"outputs that differ: {differing} of {len(one)} compared")


if __name__ == "__main__":
    main()
