"""Self-distillation of a trained checkpoint's DSpark draft layers from its frozen backbone (train/README.md).

    python -m train.distill --loss both --greedy train/data/greedy_train.npz \
        --greedy-heldout train/data/greedy_heldout.npz --out out/distill   # writes out/distill/draft.safetensors
    python -m train.distill --merge out/distill/draft.safetensors          # into --checkpoint, backbone checked

Greedy verification accepts a draft only when it is the backbone's argmax, so the drafts learn the backbone's
choices rather than the data's. For a block anchored at a, position i's label is the backbone's argmax at a + i (its
choice of token a + i + 1 given x_<=a+i). That label is the greedy path's only while the data stays on it, that is
while x_{a+1..a+i} are the backbone's argmaxes at a .. a+i-1: the hard cross-entropy at i is weighted by that mask
("on path"). The soft loss is the KL divergence from the backbone's distribution at a + i to the draft's, at every
position. The Markov term's previous token is the data's x_{a+i} (train/draft.py), which on the path is the accepted
draft the engine feeds (deepinfer/dspark.py). A position counts as verified when it is on the path and the drafts
before it match their labels, as the engine verifies a draft only after accepting the ones before it; the
confidence head learns acceptance on verified positions (its estimate given the drafts before it are accepted).

Batches are corpus windows or, `--greedy-fraction` of the steps, the backbone's own greedy continuations
(train/greedy.py; `--generate` makes more first), whose continuations are on the path throughout: decoding
conditions on the model's text, which repeats itself far more than the corpus. The export holds the drafts of the
held-out evaluation with the most tokens per step (the greedy walk's when `--greedy-heldout` is given).

Only the draft-owned parameters (`mtp.*`: the draft layers, `main_proj`/`main_norm`, the main keys' `wkv`/`kv_norm`,
the Markov and confidence heads) train; embedding and output head are the backbone's and stay frozen, so every
backbone tensor of the export is byte-identical to the checkpoint's (checked before writing and when merging).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from deepinfer.checkpoint import load_checkpoint, save_checkpoint
from deepinfer.config import DeepseekV41Config
from deepinfer.dspark import DraftHead
from deepinfer.models import DeepseekV41Flash
from train.draft import block_positions, confidence_logits, run_drafts, sample_anchors
from train.export import checkpoint_tensors
from train.greedy import continue_by_recompute, random_prompts
from train.kernels import TrainingKernels
from train.replay import ranking_auc, scheduled_walk
from train.train import Batches, backbone_forward, lr_at, make_optimizer, trainable_params

CHECKPOINT = Path("deepinfer/checkpoints/v41-tiny-stdlib")
DRAFT_FILE = "draft.safetensors"
LOSSES = ("hard", "kl", "both")


def is_draft_owned(name: str) -> bool:
    return name.startswith("mtp.")


def frozen_backbone(checkpoint: Path, device: torch.device) -> tuple[DeepseekV41Flash, dict[str, torch.Tensor]]:
    """The checkpoint's model and its graph parameters on `device` (fp32), trainable only where draft-owned."""
    model = DeepseekV41Flash.from_pretrained(checkpoint)
    params = trainable_params(model, device)
    for name, t in params.items():
        if not is_draft_owned(name):
            t.requires_grad_(False)
    return model, params


def greedy_labels(teacher: torch.Tensor, seqs: torch.Tensor, anchors: torch.Tensor,
                  block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block position the backbone's argmax at a + i and whether the data is on the greedy path there.

    teacher [B, T, vocab] (the backbone's logits), seqs [B, T + 1], anchors [B, K] -> labels [B, K, block] (int64)
    and on_path [B, K, block] (float: 1 where x_{a+1..a+i} are the argmaxes at a .. a+i-1; always 1 at i = 0).
    """
    greedy = teacher.argmax(-1)  # [B, T]
    follows = (greedy == seqs[:, 1:]).float()  # [B, T]: x_{t+1} is the greedy choice at t
    rows = torch.arange(seqs.shape[0], device=seqs.device)[:, None, None]
    positions = block_positions(anchors, block, seqs.device)
    path = follows[rows, positions[..., :-1]].cumprod(-1)  # [B, K, block - 1]
    return greedy[rows, positions], torch.cat([torch.ones_like(path[..., :1]), path], dim=-1)


def draft_outcomes(graphs, params, kernels: TrainingKernels, seqs: torch.Tensor, anchors: torch.Tensor,
                   confidence_grad: float = 0.0) -> dict[str, torch.Tensor]:
    """The backbone and the drafts over `seqs` [B, T + 1] (on the device) at `anchors` [B, K], per draft row
    (B * K * block): draft logits with the Markov term, the backbone's greedy labels, on_path (float), the
    backbone's log-probabilities at the same positions, and the confidence head's features (`confidence_grad`:
    train/draft.py's `run_drafts`)."""
    graph, draft_graph, head, config = graphs
    batch, length, block = seqs.shape[0], seqs.shape[1] - 1, config.dspark_block_size
    out = backbone_forward(graph, params, kernels, seqs)
    teacher = out["logits"].detach().reshape(batch, length, -1)
    labels, on_path = greedy_labels(teacher, seqs, anchors, block)
    logits, features = run_drafts(draft_graph, params, kernels, head, config, seqs, out["draft_keys"], anchors,
                                  confidence_grad)
    rows = torch.arange(batch, device=seqs.device)[:, None, None]
    target = teacher[rows, block_positions(anchors, block, seqs.device)].reshape(logits.shape)
    return {"logits": logits, "labels": labels.reshape(-1), "on_path": on_path.reshape(-1),
            "target": torch.log_softmax(target, -1), "features": features}


def distill_losses(graphs, params, kernels: TrainingKernels, seqs: torch.Tensor, anchors: torch.Tensor,
                   confidence_grad: float = 0.0) -> dict[str, torch.Tensor]:
    """Losses of one batch `seqs` [B, T + 1] (on the device) at `anchors` [B, K]: masked hard cross-entropy
    ("hard"), KL to the backbone ("kl"), confidence BCE (`confidence_grad` of its gradient reaching the draft layers);
    and, no grad, per block position the counts of verified and accepted drafts and the sum of confidences on
    verified ones ([block] each)."""
    head, block = graphs[2], graphs[3].dspark_block_size
    o = draft_outcomes(graphs, params, kernels, seqs, anchors, confidence_grad)
    logits, labels, on_path = o["logits"], o["labels"], o["on_path"]
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    kl = torch.nn.functional.kl_div(torch.log_softmax(logits, -1), o["target"], reduction="batchmean",
                                    log_target=True)
    hit = (logits.detach().argmax(-1) == labels).float().reshape(-1, block)
    before = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].cumprod(-1)], dim=-1)  # drafts before i all accepted
    verified = on_path.reshape(-1, block) * before  # [blocks, block]
    z = confidence_logits(head, o["features"])
    bce = torch.nn.functional.binary_cross_entropy_with_logits(z, hit.reshape(-1), reduction="none")
    return {"hard": (on_path * ce).sum() / on_path.sum(), "kl": kl,
            "confidence_bce": (verified.reshape(-1) * bce).sum() / verified.sum().clamp_min(1.0),
            "verified": verified.sum(0), "accepted": (verified * hit).sum(0),
            "confidence": (verified * torch.sigmoid(z.detach()).reshape(-1, block)).sum(0)}


def acceptance_summary(verified: torch.Tensor, accepted: torch.Tensor, confidence: torch.Tensor) -> dict:
    """Acceptance by block position (accepted / verified), the expected tokens per verifying step with every draft
    verified, 1 + sum_k prod_{i<=k} p_i, and the mean confidence on verified positions."""
    p = accepted / verified.clamp_min(1.0)
    return {"acceptance": [round(float(x), 4) for x in p],
            "tokens_per_step": round(1.0 + float(p.cumprod(0).sum()), 4),
            "confidence": [round(float(x), 4) for x in confidence / verified.clamp_min(1.0)],
            "verified": [int(x) for x in verified]}


@torch.no_grad()
def heldout_metrics(graphs, params, kernels, seqs: torch.Tensor, device, batch: int, anchors: int) -> dict:
    """Mean held-out losses and the acceptance summary over `seqs`, same anchors every time."""
    gen, sums, count = torch.Generator().manual_seed(1234), {}, 0
    block = graphs[3].dspark_block_size
    for i in range(0, len(seqs), batch):
        chunk = seqs[i : i + batch].to(device)
        picked = sample_anchors(len(chunk), chunk.shape[1] - 1, anchors, block, gen)
        for name, value in distill_losses(graphs, params, kernels, chunk, picked).items():
            sums[name] = sums.get(name, 0.0) + value.float().cpu()
        count += 1
    out = {name: round(float(sums[name]) / count, 4) for name in ("hard", "kl", "confidence_bce")}
    return out | acceptance_summary(sums["verified"], sums["accepted"], sums["confidence"])


@torch.no_grad()
def greedy_walk(graphs, params, kernels, seqs: torch.Tensor, prompt_lens: torch.Tensor, device, batch: int,
                budget: float = 4.0) -> dict:
    """Acceptance as the engine counts it (static drafts of a whole block, greedy) on greedy continuations `seqs`
    [S, T + 1] of prompts of `prompt_lens` [S] tokens: the first block is anchored at the first generated token and
    each next one after the tokens a step gives (accepted drafts plus one); position i's rate is how often the drafts
    up to i were all accepted, per step (bench/dspark_bench.py's figure), and tokens per step 1 + their sum.

    Also the walk of all S sequences as one batch under a verification budget of `budget` tokens a running request
    (`scheduled_walk`), and how well each confidence's cumulative product ranks the drafts (`ranking_auc`)."""
    head, block, length = graphs[2], graphs[3].dspark_block_size, seqs.shape[1] - 1
    every = torch.arange(1, length - block + 1)  # [A]: all anchors, a at index a - 1
    steps, accepted, all_runs, scores = 0, torch.zeros(block), [], {"head": [], "draft": []}
    for i in range(0, len(seqs), batch):
        chunk = seqs[i : i + batch].to(device)
        o = draft_outcomes(graphs, params, kernels, chunk, every.expand(len(chunk), -1))
        picks = o["logits"].argmax(-1)
        hit = (picks == o["labels"]).float() * o["on_path"]
        runs = hit.reshape(len(chunk), len(every), block).cumprod(-1).sum(-1).long().cpu()  # [S, A]: drafts accepted
        all_runs.append(runs)
        shape = (len(chunk), len(every), block)
        scores["head"].append(torch.sigmoid(confidence_logits(head, o["features"])).reshape(shape).cpu())
        scores["draft"].append(torch.softmax(o["logits"].float(), -1).gather(-1, picks[:, None]).reshape(shape).cpu())
        for row, prompt in zip(runs, prompt_lens[i : i + batch].tolist(), strict=True):
            a = prompt
            while a <= len(every):
                n = int(row[a - 1])
                steps, accepted[:n] = steps + 1, accepted[:n] + 1
                a += n + 1
    rates = accepted / max(steps, 1)
    runs, scores = torch.cat(all_runs), {name: torch.cat(s) for name, s in scores.items()}
    out = {"walk_acceptance": [round(float(x), 4) for x in rates], "walk_tokens_per_step": round(1 + float(rates.sum()), 4),
           "walk_steps": steps}
    out |= {f"auc_{name}": ranking_auc(s, runs, prompt_lens) for name, s in scores.items()}
    return out | {f"scheduled_{budget:g}": scheduled_walk(runs, scores, prompt_lens, budget)}


def draft_tensors(params: dict[str, torch.Tensor], config: DeepseekV41Config,
                  shipped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The export's draft-owned tensors, after checking that its every other tensor is the shipped one's bytes."""
    tensors = checkpoint_tensors(params, config)
    changed = [n for n, t in tensors.items() if not is_draft_owned(n) and not same_bytes(t, shipped.get(n))]
    if changed or set(tensors) != set(shipped):
        raise RuntimeError(f"the backbone changed: {changed[:5]}; names differ: {sorted(set(tensors) ^ set(shipped))}")
    return {n: t for n, t in tensors.items() if is_draft_owned(n)}


def same_bytes(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    if b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def merge(draft_file: Path, checkpoint: Path) -> None:
    """Replace the draft-owned tensors of `checkpoint` by `draft_file`'s, leaving every other tensor's bytes as they
    were (checked after writing)."""
    config = DeepseekV41Config.from_pretrained(checkpoint)
    shipped = {n: t.clone() for n, t in load_checkpoint(checkpoint, config).items()}
    drafts = load_file(draft_file)
    owned = {n for n in shipped if is_draft_owned(n)}
    if set(drafts) != owned or any(drafts[n].dtype != shipped[n].dtype or drafts[n].shape != shipped[n].shape
                                   for n in owned):
        raise ValueError(f"{draft_file} does not hold exactly the checkpoint's draft tensors in their dtypes and shapes")
    staging = checkpoint.with_name(checkpoint.name + ".merge")
    shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint({n: drafts.get(n, t) for n, t in shipped.items()}, staging)
    merged = load_checkpoint(staging, config)
    changed = [n for n, t in shipped.items() if not same_bytes(merged[n], drafts.get(n, t))]
    if changed:
        raise RuntimeError(f"the merged checkpoint differs from what was written: {changed[:5]}")
    shutil.copymode(checkpoint / "model.safetensors", staging / "model.safetensors")
    (staging / "model.safetensors").replace(checkpoint / "model.safetensors")
    staging.rmdir()
    print(f"{checkpoint}: {len(owned)} draft tensors replaced, {len(shipped) - len(owned)} backbone tensors unchanged")


def generate(graph, params, kernels, ids: np.ndarray, args: argparse.Namespace,
             device: torch.device) -> tuple[torch.Tensor, float]:
    """`args.generate` greedy continuations of training prompts (as train/greedy.py makes them, other prompts), of
    the --greedy file's length (129 without one), and the seconds they took."""
    length = np.load(args.greedy)["seqs"].shape[1] if args.greedy else 129
    prompts, lens = random_prompts(ids, args.generate, length, (8, 64), args.seed + 1)
    start, made = time.perf_counter(), []
    for i in range(0, args.generate, args.generate_batch):
        chunk = slice(i, i + args.generate_batch)
        made.append(continue_by_recompute(graph, params, kernels, prompts[chunk].to(device), lens[chunk].to(device)))
    return torch.cat(made).cpu(), time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="self-distil the DSpark draft layers from the frozen backbone")
    p.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    p.add_argument("--data", type=Path, default=Path("train/data"))
    p.add_argument("--out", type=Path, default=Path("out/distill"))
    p.add_argument("--merge", type=Path, default=None, help="merge this draft file into --checkpoint and stop")
    p.add_argument("--loss", choices=LOSSES, default="both", help="masked hard cross-entropy, KL, or their sum")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--anchors", type=int, default=32, help="draft blocks per sequence")
    p.add_argument("--steps", type=int, default=100000, help="at most this many steps")
    p.add_argument("--time-budget", type=float, default=300.0, help="seconds of training; the schedule ends there")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--balance-rate", type=float, default=1e-3, help="gate-bias step of the draft layers' balancing")
    p.add_argument("--greedy", type=Path, default=None, help="greedy continuations to mix in (train/greedy.py)")
    p.add_argument("--greedy-fraction", type=float, default=0.5, help="share of steps that train on --greedy")
    p.add_argument("--greedy-batch", type=int, default=512, help="sequences per step on --greedy")
    p.add_argument("--generate", type=int, default=0, help="greedy continuations to make first (train split)")
    p.add_argument("--generate-batch", type=int, default=1024)
    p.add_argument("--greedy-heldout", type=Path, default=None, help="held-out continuations for the engine's walk")
    p.add_argument("--confidence-grad", type=float, default=0.0,
                   help="share of the confidence loss's gradient that reaches the draft layers (0: the head alone)")
    p.add_argument("--confidence-weight", type=float, default=1.0, help="the confidence loss's weight in the total")
    p.add_argument("--walk-budget", type=float, default=4.0,
                   help="verification tokens a running request in the held-out walk's scheduled replay")
    p.add_argument("--select", choices=("walk", "scheduled"), default="walk",
                   help="export the evaluation with the most walk tokens a step (static, whole blocks) or the most "
                        "under confidence scheduling at --walk-budget")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.merge is not None:
        return merge(args.merge, args.checkpoint)
    if args.select == "scheduled" and args.greedy_heldout is None:
        raise SystemExit("--select scheduled needs --greedy-heldout (the walk it scores)")
    if not 0.0 <= args.confidence_grad <= 1.0:
        raise SystemExit(f"--confidence-grad must be in [0, 1], got {args.confidence_grad}")
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model, params = frozen_backbone(args.checkpoint, device)
    config = model.config
    shipped = load_checkpoint(args.checkpoint, config)
    graphs = (model.graph(dspark=True), model.draft_graph(), DraftHead(params, config), config)
    kernels = TrainingKernels(params, config.num_hidden_layers, indexer_loss=False)
    draft_biases = {id(t) for n, t in params.items() if is_draft_owned(n) and n.endswith(".gate.bias")}
    train = Batches(np.load(args.data / "train_ids.npy"), np.load(args.data / "train_starts.npy"), args.seq_len,
                    args.seed)
    held = Batches(np.load(args.data / "heldout_ids.npy"), np.load(args.data / "heldout_starts.npy"), args.seq_len, 0)
    held_seqs, gen = held.fixed(args.eval_seqs), torch.Generator().manual_seed(args.seed)
    greedy = torch.from_numpy(np.load(args.greedy)["seqs"]) if args.greedy else None
    if args.generate:
        made, seconds = generate(graphs[0], params, kernels, np.load(args.data / "train_ids.npy"), args, device)
        greedy = made if greedy is None else torch.cat([greedy, made])
        print(f"{len(made)} greedy continuations made in {seconds:.0f} s; {len(greedy)} in all", flush=True)
    walk = np.load(args.greedy_heldout) if args.greedy_heldout else None
    opt = make_optimizer(params, args.lr, args.weight_decay)
    trained = [t for t in params.values() if t.requires_grad]
    args.out.mkdir(parents=True, exist_ok=True)
    record = {"args": {k: str(v) for k, v in vars(args).items()}, "parameters": sum(t.numel() for t in trained),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "curve": []}
    print(f"{record['parameters'] / 1e6:.2f}M draft parameters trained on {record['device']}", flush=True)
    start, best = time.perf_counter(), {"score": float("-inf")}

    def evaluate(step: int) -> None:
        point = {"step": step, "time_s": round(time.perf_counter() - start, 1), "lr": opt.param_groups[0]["lr"],
                 "heldout": heldout_metrics(graphs, params, kernels, held_seqs, device, args.batch, args.anchors)}
        if walk is not None:
            point["heldout"] |= greedy_walk(graphs, params, kernels, torch.from_numpy(walk["seqs"]),
                                            torch.from_numpy(walk["prompt_lens"]), device, args.batch,
                                            args.walk_budget)
        record["curve"].append(point)
        tqdm.write(json.dumps(point))
        held = point["heldout"]
        score = held.get("walk_tokens_per_step", held["tokens_per_step"])
        if args.select == "scheduled":
            score = held[f"scheduled_{args.walk_budget:g}"]["head"]
        if score > best["score"]:
            best.update(score=score, step=step, drafts=draft_tensors(params, config, shipped))

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        """A step's sequences (on the device) and anchors: greedy continuations or corpus windows."""
        if greedy is not None and torch.rand((), generator=gen) < args.greedy_fraction:
            seqs = greedy[torch.randint(len(greedy), (args.greedy_batch,), generator=gen)]
        else:
            seqs = train.sample(args.batch)
        length = seqs.shape[1] - 1
        return seqs.to(device), sample_anchors(len(seqs), length, args.anchors, config.dspark_block_size, gen)

    evaluate(0)
    start = time.perf_counter()
    step, bar = 0, tqdm(total=args.steps, desc="distill", unit="step", mininterval=10.0)
    while step < args.steps:
        progress = max(step / args.steps, (time.perf_counter() - start) / args.time_budget)
        if progress >= 1.0:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, args.lr, args.warmup)
        losses = distill_losses(graphs, params, kernels, *batch(), confidence_grad=args.confidence_grad)
        total = args.confidence_weight * losses["confidence_bce"] + sum(losses[k] for k in ("hard", "kl") if args.loss in (k, "both"))
        opt.zero_grad(set_to_none=True)
        total.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(trained, 1.0)
        step += 1
        if bool(torch.isfinite(grad_norm)):
            opt.step()
            kernels.balance(args.balance_rate, only=draft_biases)
        bar.update(1)
        bar.set_postfix({k: f"{float(losses[k].detach()):.3f}" for k in ("hard", "kl", "confidence_bce")}, refresh=False)
        if step % args.eval_every == 0:
            evaluate(step)
    bar.close()
    if record["curve"][-1]["step"] != step:
        evaluate(step)
    record.update(steps=step, train_time_s=round(time.perf_counter() - start, 1), exported_step=best["step"])
    save_file(best["drafts"], args.out / DRAFT_FILE, metadata={"format": "pt"})  # the best held-out evaluation's
    (args.out / "distill_record.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
