"""The DSpark draft loss, on the main keys the backbone's forward (`graph(dspark=True)`) gives for every token.

For anchors a (random positions of each sequence, 1 <= a <= T - block), the block is [x_a, noise, ...] at positions
a .. a + block - 1, attending to the `sliding_window` main keys before a and to itself; block position i predicts
x_{a+1+i} with the draft logits plus the Markov term of the previous true token x_{a+i} (teacher forcing). The
confidence head learns whether the draft's argmax at i is x_{a+1+i}, from inputs detached here (train/distill.py can
let a share of its gradient into the draft layers).

The blocks' windows are gathered from `draft_keys` in one indexing op (what `deepinfer.dspark.block_states` holds
per block, without a state per block), and the draft graph runs batched over blocks (train/batched.py).
train/distill.py runs the same drafts against the backbone's own greedy choices instead of the data's tokens.
"""

from __future__ import annotations

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.dspark import DraftHead
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret


def sample_anchors(batch: int, length: int, per_seq: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct anchors [B, K] in 1 .. length - block for each sequence of `length` input tokens."""
    span = length - block
    return torch.stack([torch.randperm(span, generator=gen)[:per_seq] + 1 for _ in range(batch)])


def block_positions(anchors: torch.Tensor, block: int, device: torch.device) -> torch.Tensor:
    """The positions a .. a + block - 1 of each anchor's block: anchors [B, K] -> [B, K, block] on `device`."""
    return anchors.to(device)[..., None] + torch.arange(block, device=device)


def gather_windows(draft_keys: torch.Tensor, anchors: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block the `window` main keys before its anchor: draft_keys [B, T, n, D], anchors [B, K] ->
    keys [B * K, n, W, D] (zeros where the sequence has no such position) and valid [B * K, W]."""
    batch, per_seq = anchors.shape
    at = anchors.to(draft_keys.device)[..., None] - window + torch.arange(window, device=draft_keys.device)
    valid = at >= 0  # [B, K, W]
    rows = torch.arange(batch, device=draft_keys.device)[:, None, None]
    keys = draft_keys[rows, at.clamp_min(0)] * valid[..., None, None]  # [B, K, W, n, D]
    return keys.permute(0, 1, 3, 2, 4).reshape(batch * per_seq, draft_keys.shape[2], window, -1), \
        valid.reshape(batch * per_seq, window)


def run_drafts(draft_graph, params: dict[str, torch.Tensor], kernels, head: DraftHead, config: DeepseekV41Config,
               seqs: torch.Tensor, draft_keys: torch.Tensor, anchors: torch.Tensor,
               confidence_grad: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft layers over every anchor's block, teacher-forced: the logits with the Markov term of the token
    before each position [B * K * block, vocab], and the confidence head's inputs [B * K * block, hidden + rank],
    through which `confidence_grad` of the gradient reaches the draft layers and the Markov embedding (0: detached,
    the head learns alone; 1: all of it).

    seqs [B, T + 1] on the device, draft_keys [B * T, n, D], anchors [B, K] (CPU).
    """
    batch, block, device = anchors.shape[0], config.dspark_block_size, seqs.device
    length = seqs.shape[1] - 1
    windows, valid = gather_windows(draft_keys.reshape(batch, length, *draft_keys.shape[1:]), anchors,
                                    config.sliding_window)
    rows = torch.arange(batch, device=device)[:, None, None]
    previous = seqs[rows, block_positions(anchors, block, device)]  # [B, K, block]
    ids = torch.full_like(previous, config.dspark_noise_token_id)
    ids[..., 0] = previous[..., 0]
    states = [SequenceState(num_tokens=a) for a in anchors.reshape(-1).tolist()]
    ctx = ForwardContext(states, [block] * len(states), device=device)
    kernels.draft_windows = (windows, valid)
    try:
        out = interpret(draft_graph, {"input_ids": ids.reshape(-1)}, params, ctx, kernels.kernels)
    finally:
        kernels.draft_windows = None
    emb, markov = head.markov(previous.reshape(-1))
    features = torch.cat([scale_grad(out["hidden"].float(), confidence_grad), scale_grad(emb, confidence_grad)], dim=-1)
    return out["logits"] + markov, features


def scale_grad(x: torch.Tensor, share: float) -> torch.Tensor:
    """`x`'s value, with `share` of the gradient passed back through it (0: detached)."""
    if share == 0.0:
        return x.detach()
    return x if share == 1.0 else share * x + (1.0 - share) * x.detach()


def confidence_logits(head: DraftHead, features: torch.Tensor) -> torch.Tensor:
    """The confidence head's logits [n] (before the sigmoid) on `run_drafts`' features, differentiable in its
    projection only."""
    return torch.nn.functional.linear(features, head.proj.float()).squeeze(-1) / head.temperature


def draft_loss(draft_graph, params: dict[str, torch.Tensor], kernels, head: DraftHead, config: DeepseekV41Config,
               seqs: torch.Tensor, draft_keys: torch.Tensor, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
    """Draft cross-entropy, confidence BCE, and (no grad) per-position draft accuracy [block] and mean confidence.

    seqs [B, T + 1] on the device (inputs and targets), draft_keys [B * T, n, D], anchors [B, K] (CPU).
    """
    block = config.dspark_block_size
    logits, features = run_drafts(draft_graph, params, kernels, head, config, seqs, draft_keys, anchors)
    rows = torch.arange(anchors.shape[0], device=seqs.device)[:, None, None]
    targets = seqs[rows, block_positions(anchors, block, seqs.device) + 1].reshape(-1)  # [B * K * block]
    ce = torch.nn.functional.cross_entropy(logits, targets)
    hit = (logits.detach().argmax(-1) == targets).float()
    z = confidence_logits(head, features)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(z, hit)
    return {"draft_ce": ce, "confidence_bce": bce, "draft_accuracy": hit.reshape(-1, block).mean(0),
            "confidence": torch.sigmoid(z.detach()).reshape(-1, block).mean(0)}
