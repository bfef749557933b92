"""Per step, how far the sm90 target's CUDA-graph steps (padded to a bucket) are from its eager ones, on the trained
checkpoint and the feeds of tests/test_gpu_cuda_graphs.py (prompts of 37, 5 and 130 tokens, decode steps, a fourth
sequence joining), with the prefill GEMM serving forwards over each given token count. Also each path against
itself run again, so a difference can be told from non-determinism. On a GPU:

    python bench/graphs_vs_eager.py [--prefill-after 512,64] [--invariant]

Written for the GPU test that failed when the prefill GEMM also served the 512 bucket (bench/RESULTS.md, sixth
session; with 64, the 172-token prefill is the first step that takes it). bench/padded_vs_unpadded.py --nodes found
the cause, Engram's gate in torch (its reductions' bits followed the row count); with its kernel every step is equal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import deepinfer  # noqa: E402
import kernels.linear.prefill as linear_prefill  # noqa: E402
from deepinfer.default_model import TRAINED_CHECKPOINT  # noqa: E402
from deepinfer.models import DeepseekV41Flash  # noqa: E402
from tests.test_gpu_cuda_graphs import run  # noqa: E402


def differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> str:
    return " ".join("=" if torch.equal(x, y) else f"{float((x - y).abs().max()):.1e}" for x, y in zip(a, b))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-after", default="512,64", help="token counts over which the prefill GEMM serves")
    p.add_argument("--invariant", action="store_true", help="batch-invariant configs (else the buckets' tuned ones)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)
    for after in (int(a) for a in args.prefill_after.split(",")):
        linear_prefill.serves = lambda m, *_, after=after: m > after  # read when a plan is made
        eager = deepinfer.compile(model, target="sm90")
        eager.runtime.cuda_graphs = False
        graphs = deepinfer.compile(model, target="sm90")
        graphs.runtime.cuda_graphs = True
        a, b = run(graphs, args.invariant), run(eager, args.invariant)
        print(f"prefill GEMM over {after} tokens, per step max |graphs - eager|: {differences(a, b)}")
        print(f"  eager again: {differences(run(eager, args.invariant), b)}")
        graphs.runtime.cuda_graphs = True  # fresh graphs: captured again
        print(f"  graphs again: {differences(run(graphs, args.invariant), a)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
