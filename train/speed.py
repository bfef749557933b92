"""Steps per second of training (forward, backward, AdamW step) at a few batch sizes, to size a timed run.

    python -m train.speed --batches 16 32 64
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer.dspark import DraftHead
from train.kernels import TrainingKernels
from train.train import Batches, build_model, forward_losses, make_optimizer, trainable_params


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", default="train/data")
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--draft-anchors", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(Path(args.data), 0)
    params = trainable_params(model, device)
    graphs = (model.graph(dspark=True), model.draft_graph(), DraftHead(params, model.config), model.config)
    kernels = TrainingKernels(params, model.config.num_hidden_layers)
    data = Batches(np.load(Path(args.data) / "train_ids.npy"), np.load(Path(args.data) / "train_starts.npy"),
                   args.seq_len, 0)
    opt, gen = make_optimizer(params, 1e-4, 0.1), torch.Generator().manual_seed(0)
    for batch in args.batches:
        times = []
        for step in range(args.steps + 2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            losses = forward_losses(graphs, params, kernels, data.sample(batch), device, args.draft_anchors, gen)
            total = losses["lm"] + 0.1 * losses["indexer_kl"] + losses.get("draft_ce", 0) + losses.get(
                "confidence_bce", 0)
            opt.zero_grad(set_to_none=True)
            total.backward()
            opt.step()
            kernels.balance(1e-3)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        step_s = float(np.median(times[2:]))
        memory = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        print(f"batch {batch} x {args.seq_len}: {step_s * 1e3:.0f} ms/step, "
              f"{batch * args.seq_len / step_s / 1e3:.0f}k tokens/s, peak {memory:.1f} GiB, "
              f"loss {float(losses['lm']):.3f}", flush=True)


if __name__ == "__main__":
    main()
