"""DSpark as the engine's speculator (deepinfer/engine/speculator.py): the verification budget's plan, verification
around the engine's sampler, and the drafter.

Each step the budget for the decoding sequences gives each one token and shares the rest among their drafts, by the
cumulative products of their confidences or by a static length (deepinfer/dspark.py); the verified sequences keep
their accepted drafts and the target's token after them, their rejected positions are taken back
(`rollback`), and the draft layers propose every sampled sequence's next drafts from its last token.
"""

from __future__ import annotations

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.dspark import allocate_by_confidence, allocate_static
from deepinfer.engine.sampler import Draw, Sampler, Tokens
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.spec_decode.config import SpeculativeConfig
from deepinfer.engine.spec_decode.drafter import Drafter
from deepinfer.engine.spec_decode.verifier import verify
from deepinfer.engine.speculator import Proposal
from deepinfer.engine.token_constraint import TokenConstraint
from graphs.compiled_model import RunnableModel


class DSparkSpeculator:
    """The `Speculator` of `config` for `compiled` (compiled with drafting), sampling as the engine does."""

    def __init__(self, compiled: RunnableModel[DeepseekV41Config], config: SpeculativeConfig, eos_token_ids: tuple[int, ...],
                 batch_invariant: bool) -> None:
        self.compiled, self.config = compiled, config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.drafter = Drafter(compiled, config, eos_token_ids, batch_invariant)
        self.sampler = Sampler(eos_token_ids)
        self.draft_lengths: dict[int, int] = {}  # each drafting sequence's draft block this step

    def plan(self, decoding: list[Sequence], budget: int) -> dict[int, list[int]]:
        """The drafts each decoding sequence verifies: from its proposal, never past its max_tokens, within the
        config's `verify_budget` (at most `budget`)."""
        k = self.num_speculative_tokens
        confidences = torch.zeros(len(decoding), k)
        available = torch.zeros(len(decoding), dtype=torch.int64)
        for i, seq in enumerate(decoding):
            if seq.proposal is not None:
                # Never past max_tokens: the step's tokens are the verified drafts and one more.
                available[i] = max(0, min(len(seq.proposal.tokens), seq.max_tokens - seq.num_outputs - 1, k))
                confidences[i, : len(seq.proposal.confidences)] = torch.tensor(seq.proposal.confidences[:k])
        budget = min(self.config.verify_budget or budget, budget)
        if self.config.schedule == "static":
            counts = allocate_static(k, available, budget)
        else:
            counts = allocate_by_confidence(confidences, available, budget)
        return {seq.seq_id: seq.proposal.tokens[:n] for seq, n in zip(decoding, counts.tolist(), strict=True) if n}

    def verify(self, logits: torch.Tensor, allowed: torch.Tensor | None, draws: list[Draw]) -> list[Tokens]:
        """The draws' tokens (`verifier.verify`); the positions of the drafts each rejects are taken back."""
        out = verify(self.sampler, logits, allowed, draws)
        for d, (tokens, _) in zip(draws, out, strict=True):
            if d.drafts:
                num_rejected = len(d.drafts) + 1 - len(tokens)
                self.compiled.rollback(d.state, d.state.num_tokens - num_rejected, self.num_speculative_tokens)
        return out

    def propose(self, draws: list[Draw], tokens: list[list[int]],
                constraint: TokenConstraint | None) -> dict[int, Proposal]:
        """The next drafts of every draw's sequence, each block sized by the config's `draft_lengths`."""
        rows, lengths = [], []
        for d, gained in zip(draws, tokens, strict=True):
            rows.append((d.state, d.row, d.outputs + gained))
            seq_id = d.row.seq_id
            self.draft_lengths[seq_id] = self.config.next_length(self.draft_lengths.get(seq_id), len(d.drafts),
                                                                 len(gained) - 1)
            lengths.append(self.draft_lengths[seq_id])
        made = self.drafter.propose(rows, None if constraint is None else constraint.fill_next, lengths)
        return {d.row.seq_id: p for d, p in zip(draws, made, strict=True)}

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.draft_lengths.pop(seq_id, None)
