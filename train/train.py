"""Train the tiny V4.1 model on the stdlib corpus through the DSL interpreter, and export it.

    python -m train.corpus --out train/data               # tokenizer and token arrays (once)
    python -m train.train --data train/data --out out/v41-tiny-stdlib --time-budget 420

The forward is `interpret(graph, ...)` with every op's reference, except for the overrides of train/kernels.py
(straight-through cache rounding, the indexer's own loss, expert-load counts): one chunk of `--seq-len` tokens per
sequence, each sequence a fresh `SequenceState`, logits for every row. AdamW with warmup and a cosine decay whose
progress is the larger of steps done and time spent, so a run given a time budget ends its schedule on time. The
checkpoint is exported (bf16) every `--save-every` seconds and at the end, with train_record.json beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from deepinfer.default_model import random_weights
from deepinfer.dspark import DraftHead
from deepinfer.models import DeepseekV41Flash
from deepinfer.tokenizer import load_tokenizer
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from train.draft import draft_loss, sample_anchors
from train.export import DERIVED, export
from train.kernels import TrainingKernels
from train.tiny_config import tiny_config

FROZEN = re.compile(r"(\.gate\.bias(_vl)?|\.engram\.embed\.scale)$")  # balanced by counts; unused scales
NO_DECAY = re.compile(r"(norm\.weight|_base|_scale|attn_sink|(^|\.)embed\.weight)$")


def build_model(data: Path, seed: int) -> DeepseekV41Flash:
    """The tiny config on the tokenizer in `data`, with `random_weights` drawn from `seed`."""
    tokenizer = load_tokenizer(data)
    config = tiny_config(tokenizer.backend)
    return DeepseekV41Flash(config, random_weights(config, seed), tokenizer=tokenizer)


def trainable_params(model: DeepseekV41Flash, device: torch.device) -> dict[str, torch.Tensor]:
    """The graph's parameters on `device`: floats as fp32 leaves (requires_grad unless frozen or derived)."""
    params = {}
    for name, t in model.params().items():
        if t.is_floating_point():
            t = t.detach().to(device, torch.float32).clone()
            t.requires_grad_(name not in DERIVED and not FROZEN.search(name))
        else:
            t = t.to(device)
        params[name] = t
    return params


class Batches:
    """Sequences of `seq_len` + 1 tokens: an eighth start where a document starts (prompts often start a file),
    the rest anywhere."""

    def __init__(self, ids: np.ndarray, starts: np.ndarray, seq_len: int, seed: int) -> None:
        self.ids, self.seq_len, self.rng = torch.from_numpy(ids.astype(np.int64)), seq_len, np.random.default_rng(seed)
        self.starts = starts[starts < len(ids) - seq_len - 1]

    def sample(self, batch: int) -> torch.Tensor:
        at_docs = self.rng.choice(self.starts, batch // 8)
        anywhere = self.rng.integers(0, len(self.ids) - self.seq_len - 1, batch - batch // 8)
        return torch.stack([self.ids[s : s + self.seq_len + 1] for s in np.concatenate([at_docs, anywhere])])

    def fixed(self, batch: int) -> torch.Tensor:
        """`batch` evenly spaced sequences: the same every time (held-out evaluation)."""
        offsets = np.linspace(0, len(self.ids) - self.seq_len - 1, batch).astype(np.int64)
        return torch.stack([self.ids[s : s + self.seq_len + 1] for s in offsets])


def backbone_forward(graph, params, kernels: TrainingKernels, seqs: torch.Tensor) -> dict[str, torch.Tensor]:
    """`graph` over the inputs of `seqs` [B, T + 1] (on the device), each row a fresh sequence: its outputs
    (`logits` [B * T, vocab], and `draft_keys` [B * T, n, D] for `graph(dspark=True)`)."""
    batch, length = seqs.shape[0], seqs.shape[1] - 1
    ctx = ForwardContext([SequenceState() for _ in range(batch)], [length] * batch, device=seqs.device)
    kernels.reset()
    return interpret(graph, {"input_ids": seqs[:, :-1].reshape(-1)}, params, ctx, kernels.kernels)


def forward_losses(graphs, params, kernels: TrainingKernels, seqs: torch.Tensor, device, anchors: int,
                   gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The losses of one batch `seqs` [B, T + 1]: next-token cross-entropy over every position ("lm"), the
    indexer's KL ("indexer_kl"), and with `anchors` > 0 the draft losses of train/draft.py."""
    graph, draft_graph, head, config = graphs
    batch, length = seqs.shape[0], seqs.shape[1] - 1
    seqs = seqs.to(device)
    out = backbone_forward(graph, params, kernels, seqs)
    losses = {"lm": torch.nn.functional.cross_entropy(out["logits"], seqs[:, 1:].reshape(-1))}
    losses["indexer_kl"] = torch.as_tensor(kernels.indexer_loss_value(), device=device)
    if anchors and draft_graph is not None:
        picked = sample_anchors(batch, length, anchors, config.dspark_block_size, gen)
        losses |= draft_loss(draft_graph, params, kernels, head, config, seqs, out["draft_keys"], picked)
    return losses


def make_optimizer(params: dict[str, torch.Tensor], lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [t for n, t in params.items() if t.requires_grad and not NO_DECAY.search(n)]
    plain = [t for n, t in params.items() if t.requires_grad and NO_DECAY.search(n)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=torch.cuda.is_available())


def lr_at(step: int, progress: float, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def heldout_metrics(graphs, params, kernels, seqs: torch.Tensor, device, batch: int, anchors: int) -> dict:
    """Mean held-out losses (and draft accuracy / confidence per block position), same anchors every time."""
    gen, sums, count = torch.Generator().manual_seed(1234), {}, 0
    for i in range(0, len(seqs), batch):
        for name, value in forward_losses(graphs, params, kernels, seqs[i : i + batch], device, anchors, gen).items():
            sums[name] = sums.get(name, 0.0) + value.float().cpu()
        count += 1
    return {name: [round(float(v) / count, 4) for v in value.reshape(-1)] if value.numel() > 1
            else round(float(value) / count, 4) for name, value in sums.items()}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="train the tiny V4.1 model on the stdlib corpus")
    p.add_argument("--data", default="train/data")
    p.add_argument("--out", default="out/v41-tiny-stdlib")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=100000, help="at most this many steps")
    p.add_argument("--time-budget", type=float, default=420.0, help="seconds of training; the schedule ends there")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--indexer-loss", type=float, default=0.1, help="weight of the indexer's KL loss (0: off)")
    p.add_argument("--draft-anchors", type=int, default=32, help="draft blocks per sequence (0: no draft loss)")
    p.add_argument("--balance-rate", type=float, default=1e-3, help="gate-bias step of the load balancing")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-seqs", type=int, default=64)
    p.add_argument("--save-every", type=float, default=120.0, help="seconds between exports")
    p.add_argument("--max-shard-mb", type=float, default=12.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device, data = torch.device(args.device), Path(args.data)
    model = build_model(data, args.seed)
    config = model.config
    params = trainable_params(model, device)
    graphs = (model.graph(dspark=True), model.draft_graph(), DraftHead(params, config), config)
    kernels = TrainingKernels(params, config.num_hidden_layers, indexer_loss=args.indexer_loss > 0)
    train = Batches(np.load(data / "train_ids.npy"), np.load(data / "train_starts.npy"), args.seq_len, args.seed)
    held = Batches(np.load(data / "heldout_ids.npy"), np.load(data / "heldout_starts.npy"), args.seq_len, 0)
    held_seqs, gen = held.fixed(args.eval_seqs), torch.Generator().manual_seed(args.seed)
    opt = make_optimizer(params, args.lr, args.weight_decay)
    trained = [t for t in params.values() if t.requires_grad]
    record = {"config": config.to_dict(), "args": vars(args), "device": str(torch.cuda.get_device_name(device))
              if device.type == "cuda" else "cpu", "parameters": sum(t.numel() for t in trained),
              "train_tokens_available": len(train.ids), "heldout_tokens": len(held.ids), "curve": []}
    print(f"{record['parameters'] / 1e6:.2f}M trained parameters on {record['device']}; "
          f"{len(train.ids) / 1e6:.2f}M training tokens", flush=True)

    def evaluate(step: int, tokens: int, smooth: dict) -> dict:
        held_out = heldout_metrics(graphs, params, kernels, held_seqs, device, args.batch, args.draft_anchors)
        point = {"step": step, "tokens": tokens, "time_s": round(time.perf_counter() - start, 1),
                 "train": {k: round(v, 4) for k, v in smooth.items()}, "heldout": held_out,
                 "lr": float(opt.param_groups[0]["lr"])}
        tqdm.write(json.dumps(point))
        return point

    def save(step: int, tokens: int) -> None:
        record.update(steps=step, tokens_seen=tokens, wall_time_s=round(time.perf_counter() - start, 1))
        export(params, config, args.out, tokenizer_dir=data, record=record,
               max_shard_bytes=int(args.max_shard_mb * 2**20))

    start = last_save = time.perf_counter()
    tokens, step, smooth, best = 0, 0, {}, {"lm": float("inf")}
    bar = tqdm(total=args.steps, desc="train", unit="step", mininterval=5.0)
    while step < args.steps:
        progress = max(step / args.steps, (time.perf_counter() - start) / args.time_budget)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args.lr, args.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        seqs = train.sample(args.batch)
        losses = forward_losses(graphs, params, kernels, seqs, device, args.draft_anchors, gen)
        total = losses["lm"] + args.indexer_loss * losses["indexer_kl"]
        if "draft_ce" in losses:
            total = total + losses["draft_ce"] + losses["confidence_bce"]
        opt.zero_grad(set_to_none=True)
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        step, tokens = step + 1, tokens + seqs.shape[0] * args.seq_len
        if not bool(torch.isfinite(grad_norm)):  # a bad batch must not poison the weights
            record["skipped_steps"] = record.get("skipped_steps", 0) + 1
            continue
        opt.step()
        kernels.balance(args.balance_rate)
        for name in ("lm", "indexer_kl", "draft_ce", "confidence_bce"):
            if name in losses:
                value = float(losses[name].detach())
                smooth[name] = value if name not in smooth else 0.95 * smooth[name] + 0.05 * value
        bar.update(1)
        bar.set_postfix({k: f"{v:.3f}" for k, v in smooth.items()} | {"lr": f"{lr:.1e}"}, refresh=False)
        if step % args.eval_every == 0 or step == 1:
            record["curve"].append(evaluate(step, tokens, smooth))
            if record["curve"][-1]["heldout"]["lm"] < best["lm"]:
                best.update(lm=record["curve"][-1]["heldout"]["lm"], step=step,
                            params={n: t.detach().to("cpu", copy=True) for n, t in params.items()})
        if time.perf_counter() - last_save > args.save_every:
            save(step, tokens)
            last_save = time.perf_counter()
    bar.close()
    record["final"] = evaluate(step, tokens, smooth)
    if record["final"]["heldout"]["lm"] > best["lm"]:  # past its best: ship the best held-out weights
        record["exported_step"] = best["step"]
        with torch.no_grad():
            for name, t in params.items():
                t.copy_(best["params"][name].to(t.device))
    record.setdefault("exported_step", step)
    save(step, tokens)


if __name__ == "__main__":
    main()
