"""Why a sampled token broke its constraint: the constraint could not be met, or the sampler did not apply the mask.

A constrained row is sampled under the grammar's mask intersected with the request's own bans (eos and the stop
token ids while `min_tokens` is not reached, tokens outside `allowed_token_ids`). When that intersection is empty the
sampler still has to return a token and takes the best one outside the mask: the request then cannot be satisfied,
and the message says which ban met which grammar state. Only a token the intersection allowed and the grammar still
refused would be the sampler's fault.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.sampler import unpack_bitmask
from deepinfer.structured_outputs.bitmask import allocate_bitmask
from deepinfer.structured_outputs.matcher import RequestMatcher


def refusal_message(matcher: RequestMatcher, token: int, params, num_outputs: int, vocab_size: int,
                    eos_token_ids: Sequence[int]) -> str:
    """The error of a request whose constraint (in `matcher`'s state before `token`) refused `token`, sampled as
    output number `num_outputs` (0-based) with SamplingParams `params`."""
    kind = params.structured_outputs.kind
    after = f"after {num_outputs} token{'' if num_outputs == 1 else 's'}"
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_bitmask(bitmask, 0)
    allowed = set(unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist())
    if not allowed:
        return (f"the {kind} constraint allows no token of the model's vocabulary {after}: it "
                "cannot be continued with this tokenizer")
    banned, why = set(), []
    if num_outputs < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        if allowed & stops:
            banned |= stops
            why.append(f"min_tokens={params.min_tokens} bans its end (eos and the stop token ids) until then")
    allowed_ids = getattr(params, "allowed_token_ids", None)
    if allowed_ids:
        outside = allowed - set(allowed_ids)
        if outside:
            banned |= outside
            why.append("allowed_token_ids leaves out what it allows")
    if allowed <= banned:
        ends = " (only its end)" if allowed <= set(eos_token_ids) else ""
        return (f"the {kind} constraint cannot be satisfied {after}: every token it allows "
                f"here{ends} is banned, as {' and '.join(why)}")
    return (f"token {token} breaks the {kind} constraint {after}, though the mask allowed "
            f"{len(allowed - banned)} tokens there: the sampler did not apply the mask (a bug)")

