"""Replays of DSpark's verification budget over known outcomes, and how well a confidence ranks drafts: the measures
train/distill.py exports by and bench/dspark_oracle.py prints.

An outcome is how many drafts a block would have accepted had all been verified (its "run"); an allocation gives each
request a number of drafts to verify; the request gains min(run, given) + 1 tokens.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer.dspark import allocate_by_confidence, allocate_static


def auc(scores: torch.Tensor, accepted: torch.Tensor) -> float:
    """P(a random accepted draft scores above a random rejected one), ties counting half (the Mann-Whitney U over
    mean ranks); scores [n], accepted bool [n]. NaN when either side is empty."""
    pos, neg = scores[accepted].double(), scores[~accepted].double()
    if not len(pos) or not len(neg):
        return float("nan")
    _, where, counts = torch.unique(torch.cat([pos, neg]), return_inverse=True, return_counts=True)
    ranks = (counts.cumsum(0) - (counts - 1) / 2.0)[where]  # 1-based, ties at their mean rank
    u = ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2
    return float(u / (len(pos) * len(neg)))


def allocate_oracle(runs: torch.Tensor, budget: int) -> torch.Tensor:
    """Drafts each request verifies when the allocation knows the outcomes: each its accepted drafts `runs` [requests],
    the longest runs first (ties to the lower index), while the `budget - requests` spare tokens last. The ceiling of
    any allocation at that budget."""
    gets, left = torch.zeros_like(runs), budget - len(runs)
    for r in torch.argsort(runs, descending=True, stable=True).tolist():
        gets[r] = max(0, min(int(runs[r]), left))
        left -= int(gets[r])
    return gets


def ranking_auc(confidences: torch.Tensor, runs: torch.Tensor, prompt_lens: torch.Tensor) -> list[float]:
    """Per block position i, over the generated anchors of each sequence (confidences [S, A, block], runs [S, A]),
    how often a block whose drafts up to i are all accepted has a higher cumulative product of confidences up to i
    than one where they are not (`auc`)."""
    generated = torch.arange(runs.shape[1])[None, :] >= prompt_lens[:, None] - 1  # anchor a at index a - 1
    products = confidences.double().cumprod(-1)[generated]  # [n, block]
    runs = runs[generated]
    return [round(auc(products[:, i], runs > i), 4) for i in range(products.shape[1])]


def scheduled_walk(runs: torch.Tensor, confidences: dict[str, torch.Tensor], prompt_lens: torch.Tensor,
                   budget: float) -> dict[str, float]:
    """The walk of every sequence at once, as one batch of requests: each step a request at anchor a verifies the
    drafts its allocation gives it (`allocate_static` per length, `allocate_by_confidence` per confidence, or
    `allocate_oracle`), all within `round(budget * running)` tokens, and moves on by the drafts accepted plus one.
    runs [S, A] (anchor a at index a - 1), confidences {name: [S, A, block]}. Tokens a step per running request, per
    allocation."""
    block = next(iter(confidences.values())).shape[-1]

    def by_confidence(c, at, available, total):
        return allocate_by_confidence(c[at], available, total)

    rules = {f"static {k}": lambda at, available, total, k=k: allocate_static(k, available, total)
             for k in range(1, block + 1)}
    rules |= {name: partial(by_confidence, c) for name, c in confidences.items()}
    rules["oracle"] = lambda at, available, total: allocate_oracle(runs[at], total)
    out = {}
    for name, rule in rules.items():
        anchors, tokens, request_steps = prompt_lens.clone(), 0, 0
        while True:
            running = torch.nonzero(anchors <= runs.shape[1]).squeeze(-1)
            if not len(running):
                break
            at = (running, anchors[running] - 1)
            counts = rule(at, torch.full((len(running),), block, dtype=torch.int64), round(budget * len(running)))
            moved = torch.minimum(runs[at], counts) + 1
            anchors[running] += moved
            tokens, request_steps = tokens + int(moved.sum()), request_steps + len(running)
        out[name] = round(tokens / request_steps, 4)
    return out
