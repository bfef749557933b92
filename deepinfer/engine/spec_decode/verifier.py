"""Verification of drafts around the engine's sampler: the target's token at every verified position, drafts kept up
to the first that differs from it.

A decoding sequence feeds its last token followed by its drafts; the sampler samples the target's token at every one
of those positions with the request's hashed noise (the noise of a position does not depend on drafting), the drafts
are kept up to the first one that differs from the target's token, and the target's token there always follows
them. Output is therefore exactly what decoding without drafts gives, greedy or seeded, whenever the logits of a
position do not depend on how many tokens a forward holds (the engine's batch-invariant mode). Under a token
constraint each verified position is sampled under its own mask row.
"""

from __future__ import annotations

import torch

from deepinfer.engine.sampler import Draw, Sampler, Tokens


def verify(sampler: Sampler, logits: torch.Tensor, allowed: torch.Tensor | None, draws: list[Draw]) -> list[Tokens]:
    """Each draw's tokens: its drafts up to the first the target's token differs from, then the target's token.
    `logits` [rows, vocab] hold 1 + len(drafts) rows per draw from `draw.first`; `allowed` (bool) the constraint's
    mask rows, 1 + len(drafts) per draw in order, or None. A draw `sampler.picks` reads back for the whole step takes
    its tokens from there; the others are sampled position by position, up to the first rejected draft.
    Log-probabilities, when asked for, are of the raw logits (before mask and penalties)."""
    picks = sampler.picks(logits, draws) if allowed is None else None
    out, mask_row = [], 0
    for j, d in enumerate(draws):
        if picks is not None and picks[j] is not None:
            targets = picks[j]
            kept = next((i for i, (t, x) in enumerate(zip(targets, d.drafts)) if t != x), len(d.drafts))
            out.append((targets[: kept + 1], [None] * (kept + 1)))
        else:
            out.append(_sampled(sampler, logits, None if allowed is None else allowed[mask_row:], d))
        mask_row += 1 + len(d.drafts)
    return out


def _sampled(sampler: Sampler, logits: torch.Tensor, allowed: torch.Tensor | None, d: Draw) -> Tokens:
    """`verify` for one draw sampled position by position; `allowed` its mask rows first (None: no mask)."""
    tokens, logprobs = [], []
    for i in range(len(d.drafts) + 1):
        token, lp = sampler.token(logits[d.first + i], None if allowed is None else allowed[i], d.row,
                                  d.outputs + tokens)
        tokens.append(token)
        logprobs.append(lp)
        if i == len(d.drafts) or token != d.drafts[i]:
            break
    return tokens, logprobs
