"""`SamplingParams(prompt_logprobs=k)`: each prompt token's log-probability given the tokens before it, as vLLM returns.

The prompt is run once more through the compiled model on a sequence of its own, a chunk at a time, with the
logits of every position: position p's logits give token p + 1 its log-probability, its rank, and the k most likely
tokens there (-1: all of them). The first token has nothing before it: its entry is None. In batch-invariant mode
(the default) those logits are bitwise the ones the engine's prefill computed, however it chunked the prompt.
"""

from __future__ import annotations

from deepinfer.outputs import Logprob
from deepinfer.sampler import top_logprobs


def prompt_logprobs(compiled, token_ids: list[int], num_logprobs: int, tokenizer, chunk: int = 512,
                    batch_invariant: bool = True) -> list[dict[int, Logprob] | None]:
    """One entry per prompt token: None, then {token: Logprob, then the top `num_logprobs`} for each later token."""
    state = compiled.new_sequence()
    entries: list[dict[int, Logprob] | None] = [None]
    last = len(token_ids) - 1  # the last position's logits predict the first generated token: not needed
    for start in range(0, last, chunk):
        piece = token_ids[start: min(start + chunk, last)]
        logits = compiled.step([(state, piece)], all_logits=True, batch_invariant=batch_invariant)  # [len, V]
        for k in range(len(piece)):
            entry = top_logprobs(logits[k], token_ids[start + k + 1], num_logprobs)
            for tid, lp in entry.items():
                lp.decoded_token = tokenizer.decode([tid], skip_special_tokens=False)
            entries.append(entry)
    return entries
