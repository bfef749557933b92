"""On a CPU (Triton's interpreter): the sm90 plan's executor with its segments run over padded rows (NaN padding,
as graphs/capture.py pads a CUDA-graph step) against the same executor unpadded, on the trained checkpoint, with
the prefill GEMM over a given token count and the tuned (non-invariant) configs: the max difference of each step's
logits. The GPU twin of this comparison is bench/graphs_vs_eager.py. Slow: a few minutes.

    python bench/padded_vs_unpadded_cpu.py [--prefill-after 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import kernels.triton.linear_prefill as linear_prefill  # noqa: E402
import tests.kernels.conftest as kernel_tests  # noqa: E402
from deepinfer.default_model import TRAINED_CHECKPOINT  # noqa: E402
from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.context import ForwardContext, SequenceState  # noqa: E402
from dsl.passes import run_passes  # noqa: E402
from graphs.capture import CudaGraphs  # noqa: E402
from graphs.executor import Executor  # noqa: E402
from graphs.plan import make_plan  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-after", type=int, default=64, help="token counts over which the prefill GEMM serves")
    args = p.parse_args()
    kernel_tests._patch_interpreter()  # the interpreter's bf16 handling, as the kernel tests fix it
    linear_prefill.AFTER_TOKENS = args.prefill_after
    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)
    graph, params = run_passes(model.graph()), model.params()
    plan = make_plan(graph, params, "sm90")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (37, 5, 130)]
    steps = [prompts] + [[[int(t)] for t in torch.randint(4, 500, (3,), generator=gen)] for _ in range(2)]
    logits = []
    for padded in (False, True):
        executor = Executor(graph, plan, params, "cpu")
        if padded:
            executor.cuda_graphs = CudaGraphs(graph, capture=False, pad=float("nan"))
        states, out = [SequenceState() for _ in range(3)], []
        for feed in steps:
            start = time.perf_counter()
            ctx = ForwardContext(states, [len(f) for f in feed])
            out.append(executor.run({"input_ids": torch.tensor([t for f in feed for t in f])}, ctx)["logits"])
            ctx.commit()
            print(f"{'padded' if padded else 'unpadded'}: {sum(map(len, feed))} tokens in "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
        logits.append(out)
    for i, (a, b) in enumerate(zip(*logits, strict=True)):
        print(f"step {i}: max |padded - unpadded| {float((a - b).abs().max()):.3g}, NaN {bool(b.isnan().any())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
