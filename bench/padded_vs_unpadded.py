"""The sm90 plan's executor with its segments run over padded rows (as graphs/capture.py pads a CUDA-graph step,
here with NaN padding) against the same executor unpadded, on the trained checkpoint, with the prefill GEMM over a
given token count and the tuned (non-invariant) configs: each step's max logits difference, and with `--nodes` the
first nodes whose outputs differ (their first N rows). On a CPU under Triton's interpreter (slow: minutes), or on a
GPU with `--device cuda`. The CUDA-graph twin of this comparison is bench/graphs_vs_eager.py.

    python bench/padded_vs_unpadded.py [--prefill-after 64] [--device cuda] [--nodes 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if not any(a.endswith("cuda") for a in sys.argv):  # --device cuda or --device=cuda
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import kernels.linear.prefill as linear_prefill  # noqa: E402
from deepinfer.default_model import TRAINED_CHECKPOINT  # noqa: E402
from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.context import ForwardContext, SequenceState  # noqa: E402
from dsl.passes import run_passes  # noqa: E402
from dsl.ragged import Ragged  # noqa: E402
from graphs.capture import CudaGraphs  # noqa: E402
from graphs.executor import Executor  # noqa: E402
from graphs.passes import make_plan  # noqa: E402


class Recorder:
    """Every node's tensor outputs (a Ragged one's values), in order, as (node index, output position, tensor), in
    one list per step (`step()` starts the next)."""

    def __init__(self, executor: Executor) -> None:
        self.steps: list[list[tuple[int, int, torch.Tensor]]] = []
        run_node = executor._node

        def node(index, env, ctx, *rest):
            result = run_node(index, env, ctx, *rest)
            for i, r in enumerate(result):
                r = r.values if isinstance(r, Ragged) else r
                if isinstance(r, torch.Tensor):
                    self.steps[-1].append((index, i, r.detach().clone()))
            return result
        executor._node = node

    def step(self) -> None:
        self.steps.append([])


def first_differences(graph, unpadded: list, padded: list, rows: int, count: int) -> list[str]:
    """The first `count` node outputs that differ in their first `rows` rows (padded outputs have more)."""
    lines = []
    for (index, i, a), (index_b, _, b) in zip(unpadded, padded, strict=False):
        if index != index_b:
            return lines + [f"node {index}: the two runs went different ways ({index} against {index_b})"]
        if a.dim() and b.dim() and a.shape[0] == rows and b.shape[0] > rows:
            b = b[:rows]
        if a.shape != b.shape or torch.equal(a, b):
            continue
        diff = (a.float() - b.float()).abs()
        lines.append(f"node {index} {graph.nodes[index].op} output {i} {tuple(a.shape)}: max |diff| "
                     f"{float(diff.max()):.3g} (scale {float(a.float().abs().max()):.3g}), rows differing "
                     f"{int((diff.reshape(diff.shape[0], -1).amax(1) > 0).sum()) if a.dim() else '-'}")
        if len(lines) == count:
            break
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill-after", type=int, default=64, help="token counts over which the prefill GEMM serves")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cpu: Triton's interpreter")
    p.add_argument("--nodes", type=int, default=0, help="report each step's first NODES differing node outputs")
    args = p.parse_args()
    if args.device == "cpu":
        import tests.kernels.conftest as kernel_tests
        kernel_tests._patch_interpreter()  # the interpreter's bf16 handling, as the kernel tests fix it
    linear_prefill.serves = lambda m, *_: m > args.prefill_after  # instead of its measured rule
    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)
    graph, params = run_passes(model.graph()), model.params()
    plan = make_plan(graph, params, "sm90")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (37, 5, 130)]
    steps = [prompts] + [[[int(t)] for t in torch.randint(4, 500, (3,), generator=gen)] for _ in range(2)]
    logits, records = [], []
    for padded in (False, True):
        executor = Executor(graph, plan, params, args.device)
        if padded:
            executor.cuda_graphs = CudaGraphs(graph, capture=False, pad=float("nan"))
        recorder = Recorder(executor) if args.nodes else None
        states, out = [SequenceState() for _ in range(3)], []
        for feed in steps:
            start = time.perf_counter()
            ctx = ForwardContext(states, [len(f) for f in feed], device=args.device)
            if recorder:
                recorder.step()
            ids = torch.tensor([t for f in feed for t in f], device=args.device)
            out.append(executor.run({"input_ids": ids}, ctx)["logits"].cpu())
            ctx.commit()
            print(f"{'padded' if padded else 'unpadded'}: {sum(map(len, feed))} tokens in "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        logits.append(out)
        records.append(recorder.steps if recorder else [])
    for i, (a, b) in enumerate(zip(*logits, strict=True)):
        print(f"step {i}: max |padded - unpadded| {float((a - b).abs().max()):.3g}, NaN {bool(b.isnan().any())}")
    for s, (unpadded, padded) in enumerate(zip(*records)):
        lines = first_differences(graph, unpadded, padded, rows=sum(map(len, steps[s])), count=args.nodes)
        print(f"step {s}: " + ("\n  ".join(["", *lines]) if lines else "every node output equal"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
