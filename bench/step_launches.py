"""The launches one decode step of the full-width slice makes through its kernel nodes, on a machine without a GPU.

Each kernel node's lowering is traced (`Lowering.trace`, meta tensors, as the ahead-of-time builder does) at one
token count under the plan's config for it, that count alone (`exact_counts`: not the one-token launches a bucket's
trace adds for the builder): its Triton launches are counted by kernel, and so are the torch ops its
host code dispatches that make a tensor on the device (a kernel each on the GPU; views, empty tensors and host
scalars are not counted). The trace runs twice and the second pass is counted, so values made once and kept (rope's
frequencies) are left out. The cache writes and the graph's other nodes are not counted.

    python bench/step_launches.py [--tokens 1] [--target sm90]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # traces launch nothing: the kernels are only named

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_slice  # noqa: E402

from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.passes import run_passes  # noqa: E402
from graphs.passes import make_plan  # noqa: E402
from kernels.launch import use_launcher  # noqa: E402
from kernels.lowering import exact_counts  # noqa: E402
from kernels.registry import LOWERINGS  # noqa: E402

# aten ops that make no new device values: views, allocations, metadata
NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view", "reshape",
               "_reshape_alias", "_unsafe_view", "as_strided", "alias", "detach", "t", "transpose", "permute",
               "unsqueeze", "squeeze", "expand", "select", "slice", "split", "unbind", "lift_fresh"}


class DeviceOps(TorchDispatchMode):
    """Counts the aten ops that write a meta tensor (a device tensor on the GPU) and are not in `NOT_KERNELS`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if name not in NOT_KERNELS and any(isinstance(o, torch.Tensor) and o.is_meta for o in outs):
            self.ops[f"torch {name}"] += 1
        return out


def count(tokens: int, target: str) -> collections.Counter[str]:
    config = bench_slice.slice_config()
    model = DeepseekV41Flash(config, bench_slice.slice_weights(config, "meta"))
    graph = run_passes(model.graph())
    plan = make_plan(graph, model.params(), target)
    launches: collections.Counter[str] = collections.Counter()
    for counted in (False, True):
        ops = DeviceOps()
        names: collections.Counter[str] = collections.Counter()
        with use_launcher(lambda call: names.update([call.name])), ops, exact_counts():
            for node in plan.kernel_nodes():
                call = node.call(node.at(tokens, plan.buckets), graph.nodes[node.index].attrs, plan.dot_fp32,
                                 tokens=tokens)
                LOWERINGS[node.op].trace(call)
        if counted:
            launches = names + ops.ops
    return launches


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--target", default="sm90")
    args = p.parse_args()
    launches = count(args.tokens, args.target)
    triton = sum(n for k, n in launches.items() if not k.startswith("torch "))
    print(f"{args.target}, {args.tokens} token(s): {sum(launches.values())} launches ({triton} Triton, "
          f"{sum(launches.values()) - triton} torch)")
    for name, n in launches.most_common():
        print(f"{n:>5}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
