"""DSpark drafting around the draft layers' graph: the Markov term, the confidence head, the verification budget.

A draft step runs the draft layers (`DeepseekV41Flash.draft_graph`) over a block per sequence: the last accepted
token then noise tokens, at the sequence's next positions. Block position i gives the draft of the token after it:
logits `head(norm(h_i))` (the graph's) plus the Markov term `markov_head.head(markov_head.embed(previous token))`,
where the previous token is the accepted one for i = 0 and the draft just sampled after; and a confidence
`sigmoid(clamp(proj([h_i, markov embedding]) / T, -60, 60))`, the head's estimate that the draft is accepted given
the ones before it are. The verification budget goes to the drafts with the highest products of confidences.
"""

from __future__ import annotations

import torch

from deepinfer.config import DeepseekV41Config
from dsl.context import SequenceState
from dsl.unpaged_cache import UNPAGED


class DraftHead:
    """The output side of the last draft layer: Markov embedding and head, confidence projection."""

    def __init__(self, params: dict[str, torch.Tensor], config: DeepseekV41Config, temperature: float = 1.0,
                 device: torch.device | str | None = None) -> None:
        """`device`: where the draft layers' hidden states will be (default: where the weights are)."""
        if not config.num_nextn_predict_layers:
            raise ValueError("this model has no DSpark draft layers (num_nextn_predict_layers is 0)")
        if not temperature > 0:
            raise ValueError(f"the confidence temperature must be > 0, got {temperature!r}")
        last = f"mtp.{config.num_nextn_predict_layers - 1}"
        # fp32 once (the same tensors when they are fp32 already: training's gradients reach them)
        fp32 = {"device": device, "dtype": torch.float32}
        self.embed = params[f"{last}.markov_head.embed.weight"].to(**fp32)  # [vocab, rank]
        self.head = params[f"{last}.markov_head.head.weight"].to(**fp32)  # [vocab, rank]
        self.proj = params[f"{last}.confidence_head.proj.weight"].to(**fp32)  # [1, hidden + rank]
        self.temperature = temperature

    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For previous tokens [n]: their Markov embeddings [n, rank] and logit terms [n, vocab], fp32."""
        emb = self.embed[previous.long()]
        return emb, torch.nn.functional.linear(emb, self.head)

    def confidence(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Acceptance estimates [n] in [0, 1] from draft hidden states [n, hidden] and Markov embeddings [n, rank]."""
        z = torch.nn.functional.linear(torch.cat([hidden.float(), emb], dim=-1), self.proj).squeeze(-1)
        return torch.sigmoid((z / self.temperature).clamp(-60.0, 60.0))


def draft_probability(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The draft distribution's probability of each drafted token: softmax(logits)[tokens], fp32 [n], for logits
    [n, vocab] (the draft's, Markov term included, masked as the token was drafted) and tokens [n]. A confidence
    (`SpeculativeConfig.confidence="draft"`): on the trained checkpoint it ranks accepted drafts above rejected ones
    far better than the confidence head (bench/dspark_oracle.py)."""
    logits = logits.float()
    picked = logits.gather(-1, tokens.long()[:, None]).squeeze(-1)
    return torch.exp(picked - torch.logsumexp(logits, dim=-1))


def block_tokens(last_token: int, config: DeepseekV41Config, length: int | None = None) -> list[int]:
    """A draft block: the last accepted token, then noise tokens up to `length` (the config's block size)."""
    length = config.dspark_block_size if length is None else length
    return [last_token] + [config.dspark_noise_token_id] * (length - 1)


def block_states(draft_keys: torch.Tensor, anchors: list[int], config: DeepseekV41Config) -> list[SequenceState]:
    """Sequence states (unpaged) holding one sequence's main keys before each anchor, for draft blocks starting
    at the anchors: `draft_keys` [T, draft layers, head_dim] is `graph(dspark=True)`'s output over the sequence.
    Training runs the draft graph over such states; the keys keep their autograd history."""
    states = []
    for anchor in anchors:
        if not 0 < anchor <= draft_keys.shape[0]:
            raise ValueError(f"anchor {anchor} outside the sequence's {draft_keys.shape[0]} tokens")
        state = SequenceState()
        for i in range(config.num_nextn_predict_layers):
            UNPAGED.write_window(state, config.num_hidden_layers + i, draft_keys[:anchor, i],
                                 config.sliding_window + 1)
        state.num_tokens = anchor
        states.append(state)
    return states


def allocate_by_confidence(confidences: torch.Tensor, available: torch.Tensor, budget: int) -> torch.Tensor:
    """Drafts each request verifies this step, int64 [requests].

    `confidences` [requests, k]: each request's draft confidences; `available` [requests]: how many of its drafts it
    may verify (0 for a request with none); `budget`: tokens for the step. Every request gets one token (its last
    accepted token), and the remaining `budget - requests` go to the (request, position) pairs with the highest
    cumulative product of confidences, ties to the lower flat index (request-major); only available pairs compete.
    Since confidences are at most 1 the products fall along a row, so each request verifies a prefix of its drafts.
    """
    requests, k = confidences.shape
    extra = budget - requests
    if extra <= 0 or k == 0:
        return torch.zeros(requests, dtype=torch.int64)
    products = torch.cumprod(confidences.double().clamp(0.0, 1.0), dim=1)
    usable = torch.arange(k)[None, :] < available[:, None]
    products = torch.where(usable, products, torch.full_like(products, -1.0))
    order = torch.argsort(products.reshape(-1), descending=True, stable=True)[:extra]
    won = torch.zeros(requests * k, dtype=torch.bool)
    won[order] = True
    won &= usable.reshape(-1)
    return won.reshape(requests, k).sum(dim=1)


def allocate_static(length: int, available: torch.Tensor, budget: int) -> torch.Tensor:
    """Drafts each request verifies with a static draft length: min(length, available), in request order while
    the budget (one token per request first) lasts."""
    counts = torch.zeros(available.shape[0], dtype=torch.int64)
    extra = budget - available.shape[0]
    for i, n in enumerate(available.tolist()):
        take = max(0, min(length, n, extra))
        counts[i], extra = take, extra - take
    return counts
