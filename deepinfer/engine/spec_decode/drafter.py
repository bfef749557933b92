"""DSpark's drafter: the draft layers propose each sequence's next drafts, each sampled as the sampler would.

A draft pass runs the draft layers over one block per sequence (its last token, then noise tokens) at its next
positions; block position i gives the logits of draft i, plus the Markov term of the token before it, and a
confidence (the confidence head's, or the draft distribution's probability of the drafted token). Each draft is
sampled with the request's sampler and the noise of its position; under a token constraint, within the constraint's
masks and never past its end.
"""

from __future__ import annotations

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.dspark import DraftHead, block_tokens, draft_probability
from deepinfer.engine.spec_decode.config import SpeculativeConfig
from deepinfer.engine.spec_decode.greedy_drafts import GreedyDrafts
from deepinfer.engine.speculator import Proposal
from deepinfer.sampler import as_allowed, plain_greedy, plain_sampled, sample, sample_plain
from dsl.context import SequenceState
from graphs.compiled_model import RunnableModel


class Drafter:
    """Proposes the next drafts of a step's sampled sequences, on the runner's side."""

    def __init__(self, compiled: RunnableModel[DeepseekV41Config], config: SpeculativeConfig, eos_token_ids: tuple[int, ...],
                 batch_invariant: bool) -> None:
        model_config = compiled.config
        if config.num_speculative_tokens > model_config.dspark_block_size:
            raise ValueError(f"num_speculative_tokens {config.num_speculative_tokens} exceeds the model's draft "
                             f"block of {model_config.dspark_block_size} tokens")
        self.compiled, self.config = compiled, config
        self.head = DraftHead(compiled.params, model_config, config.confidence_temperature, compiled.device)
        self.eos_token_ids, self.batch_invariant = eos_token_ids, batch_invariant
        self.greedy = GreedyDrafts(self.head, config.confidence)

    def propose(self, rows: list[tuple[SequenceState, object, list[int]]], fill_next=None,
                lengths: list[int] | None = None) -> list[Proposal]:
        """Drafts for sequences (state after the step, sample row, outputs so far including the step's tokens).

        `fill_next` is the token constraint's (TokenConstraint.fill_next), or None: each draft is then sampled among
        the tokens the sequence's constraint allows after the drafts before it, and a row whose drafts end or break
        the constraint drafts no further (its last draft dropped: nothing may follow it in the verification).
        `lengths`: each row's draft block (1 to num_speculative_tokens; None: that many for every row)."""
        if not rows:
            return []
        k, cfg = self.config.num_speculative_tokens, self.compiled.config
        lengths = lengths or [k] * len(rows)
        if len(lengths) != len(rows) or not all(1 <= n <= k for n in lengths):
            raise ValueError(f"draft lengths must be 1 to {k}, one a row: got {lengths} for {len(rows)} rows")
        batch = [(state, block_tokens(outputs[-1], cfg, n)) for (state, _, outputs), n in zip(rows, lengths)]
        hidden, logits = self.compiled.draft(batch, batch_invariant=self.batch_invariant)
        hidden, logits = _blocks(hidden, lengths, k), _blocks(logits, lengths, k)
        with self.compiled.sampling():
            drafts = self._drafts(rows, hidden, logits, fill_next, lengths)
        return [Proposal(p.tokens[:n], p.confidences[:n]) for p, n in zip(drafts, lengths, strict=True)]

    def _drafts(self, rows, hidden: torch.Tensor, logits: torch.Tensor, fill_next,
                lengths: list[int]) -> list[Proposal]:
        """Each row's drafts and confidences from its draft block's hidden states and logits [rows, k, ...]: up to
        its length (the greedy paths draft all k of every row, which `propose` cuts)."""
        previous = torch.tensor([outputs[-1] for _, _, outputs in rows], device=hidden.device)
        masks = fill_next([s for _, s, _ in rows], [[] for _ in rows]) if fill_next is not None else None
        if masks is None:  # no row is constrained
            greedy = [plain_greedy(s.params, len(outputs)) for _, s, outputs in rows]
            if all(greedy):
                picks, confidences = self.greedy(hidden, logits, previous)  # every row's argmax, read back once
                return [Proposal(d, c) for d, c in zip(picks.tolist(), confidences.tolist(), strict=True)]
            vocab = logits.shape[-1]
            if all(g or plain_sampled(s.params, len(outputs), vocab) for g, (_, s, outputs) in zip(greedy, rows)):
                return self._plain_drafts(rows, hidden, logits, previous)
        return self._sampled_drafts(rows, hidden, logits, fill_next, lengths, masks, previous)

    def _sampled_drafts(self, rows, hidden: torch.Tensor, logits: torch.Tensor, fill_next, lengths: list[int],
                        masks: torch.Tensor | None, previous: torch.Tensor) -> list[Proposal]:
        """`_drafts` position by position, each draft `sample`'s under the constraint's mask after the drafts
        before it (`masks`: the first position's)."""
        k = hidden.shape[1]
        drafts: list[list[int]] = [[] for _ in rows]
        live = [True] * len(rows)
        samples = [s for _, s, _ in rows]
        confidences = torch.zeros(len(rows), k, device=hidden.device)  # positions a row does not draft keep 0
        for i in range(k + 1):  # the check after the last draft only drops it if it ends the constraint
            if i and fill_next is not None:
                masks = fill_next(samples, drafts)
            allowed = as_allowed(masks, logits.shape[-1])
            for r, d in enumerate(drafts):  # a row allowing nothing: its drafts end the constraint, or break it
                if allowed is not None and live[r] and not allowed[r].any():
                    live[r] = False
                    if d:
                        d.pop()
            if i == k:
                break
            emb, markov = self.head.markov(previous)
            if self.config.confidence == "head":
                confidences[:, i] = self.head.confidence(hidden[:, i], emb)
            for r, (_, s, outputs) in enumerate(rows):
                if live[r] and i < lengths[r]:
                    drafts[r].append(self._draft(logits[r, i] + markov[r], None if allowed is None else allowed[r],
                                                 s, outputs + drafts[r], confidences[r], i))
            previous = torch.tensor([d[-1] if d else outputs[-1] for d, (_, _, outputs) in zip(drafts, rows)],
                                    device=hidden.device)
        return [Proposal(d, c[: len(d)]) for d, c in zip(drafts, confidences.tolist(), strict=True)]

    def _draft(self, logits: torch.Tensor, allowed: torch.Tensor | None, s, seen: list[int],
               confidences: torch.Tensor, i: int) -> int:
        """One draft from its logits [vocab] (Markov term included) under `allowed`, after the tokens `seen`; with
        draft-probability confidences, its confidence goes to `confidences[i]`."""
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        token = sample(logits, s.params, s.seed, len(s.prompt_token_ids) + len(seen), seen, s.prompt_token_ids,
                       self.eos_token_ids)
        if self.config.confidence == "draft":
            confidences[i] = draft_probability(logits[None], torch.tensor([token], device=logits.device))[0]
        return token

    def _plain_drafts(self, rows, hidden: torch.Tensor, logits: torch.Tensor,
                      previous: torch.Tensor) -> list[Proposal]:
        """`_drafts` for rows that each sample greedily or from their scaled logits alone (`plain_sampled`): the
        greedy drafts' loop, the sampled rows' picks of each position drawn at once by `sample_plain` (at the
        positions `sample` would use), all k of every row, read back once."""
        sampled = [r for r, (_, s, outputs) in enumerate(rows) if not plain_greedy(s.params, len(outputs))]
        temperatures = [rows[r][1].params.temperature for r in sampled]
        seeds = [rows[r][1].seed for r in sampled]
        first = [len(rows[r][1].prompt_token_ids) + len(rows[r][2]) for r in sampled]
        index = torch.tensor(sampled, device=hidden.device)

        def draw(i: int, scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
            picks[index] = sample_plain(scores[index], temperatures, seeds, [p + i for p in first])
            return picks

        picks, confidences = self.greedy.run(hidden, logits, previous, draw)
        return [Proposal(d, c) for d, c in zip(picks.tolist(), confidences.tolist(), strict=True)]


def _blocks(values: torch.Tensor, lengths: list[int], k: int) -> torch.Tensor:
    """A draft pass's rows [sum(lengths), ...] as [len(lengths), k, ...], each block's rows first and zeros after
    them (positions past a block are drafted from and then dropped)."""
    if all(n == k for n in lengths):
        return values.reshape(len(lengths), k, -1)
    out = values.new_zeros(len(lengths), k, values.shape[-1])
    mask = torch.arange(k)[None, :] < torch.tensor(lengths)[:, None]
    out[mask.to(values.device)] = values
    return out
