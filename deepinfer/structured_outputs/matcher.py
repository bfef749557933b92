"""One request's grammar state: which tokens may come next, the tokens accepted so far, and rollback for drafts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr

from deepinfer.structured_outputs.bitmask import allow_all


class RequestMatcher:
    """An xgrammar GrammarMatcher for one sequence.

    The matcher ends (`is_terminated`) once it accepts a stop token where the grammar is complete: the engine then
    finishes the sequence with finish_reason "stop". Until then a stop token is allowed only where the grammar can
    end, so a completion that stops is a whole match.
    """

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self.num_tokens = 0  # accepted tokens, stop token included

    @property
    def xgr_matcher(self) -> xgr.GrammarMatcher:
        """The xgrammar matcher itself, for xgrammar's batched calls."""
        return self._matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 CPU [R, ceil(V / 32)]). The state is unchanged."""
        if self._matcher.is_terminated():
            allow_all(bitmask, [row])  # nothing follows the end; the engine has finished the sequence, leave it open
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False (state unchanged) if the grammar does not allow it here."""
        accepted = self._matcher.accept_token(int(token))
        self.num_tokens += accepted
        return accepted

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected drafts); a terminated matcher becomes live again."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_tokens} accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens

    def is_terminated(self) -> bool:
        """True once a stop token has been accepted at the grammar's end."""
        return self._matcher.is_terminated()

    def fill_draft_bitmask(self, bitmask: torch.Tensor, row: int, draft_tokens: Sequence[int]) -> int:
        """Fill rows row .. row + len(draft_tokens): row + i masks the token after draft_tokens[:i].

        Verifying k drafts samples k + 1 tokens (one per draft position, plus the bonus), each under its own mask.
        Rows past the first draft token the grammar refuses are left all-allowed: sampling there differs from the
        draft at that refused token, so they are discarded anyway. Returns how many drafts the grammar accepts; the
        matcher state is unchanged (the drafts are accepted to fill the rows, then rolled back).
        """
        num_valid = 0
        for i in range(len(draft_tokens) + 1):
            if i > num_valid:
                allow_all(bitmask, [row + i])
                continue
            self.fill_bitmask(bitmask, row + i)
            if i < len(draft_tokens) and not self._matcher.is_terminated() and self.accept(draft_tokens[i]):
                num_valid += 1
        self.rollback(num_valid)
        return num_valid

    def fill_after(self, bitmask: torch.Tensor, row: int, draft_tokens: Sequence[int]) -> bool:
        """Write into bitmask[row] the tokens allowed after `draft_tokens`; the state is unchanged. A row allowing
        nothing (and False) when the drafts break the grammar or end it (nothing may follow a stop token)."""
        num_valid = 0
        for token in draft_tokens:
            if self._matcher.is_terminated() or not self.accept(token):
                break
            num_valid += 1
        live = num_valid == len(draft_tokens) and not self._matcher.is_terminated()
        if live:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        else:
            bitmask[row] = 0
        self.rollback(num_valid)
        return live
