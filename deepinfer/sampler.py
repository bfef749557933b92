"""Sampling one token from a row of logits: penalties, temperature, min_p / top_k / top_p, greedy or seeded.

Seeded sampling is stateless: the noise for token id v at sequence position p of a request with seed s is
Gumbel(u) with u = uniform(hash(s, p, v)), a counter-based hash (splitmix64's mixer, exact in wrapping int64
arithmetic). Picking argmax(logits / T + Gumbel) over the allowed tokens samples from softmax(logits / T) restricted
to them, and the choice depends only on (seed, position, logits): not on the batch, the step, or drafting. The
logits are scaled as logits * (1 / T), one rounding whether T comes as a number or as a row of a tensor, so
`sample_plain` draws many rows at once with each row's `sample` token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer import logits_processors
from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """The int64 with the same low 64 bits as `value` (two's complement), so any Python int can seed."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _int64(0x9E3779B97F4A7C15)
_MUL1 = _int64(0xBF58476D1CE4E5B9)
_MUL2 = _int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it the logical shift of uint64.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's step on int64 tensors viewed as uint64: add the golden gamma, then the avalanche mixer."""
    z = x + _GOLDEN  # int64 arithmetic wraps, which is exactly uint64 arithmetic mod 2^64
    z = (z ^ _shr(z, 30)) * _MUL1
    z = (z ^ _shr(z, 27)) * _MUL2
    return z ^ _shr(z, 31)


def hash_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u[b, v] = uniform in (0, 1) from hash(seeds[b], positions[b], v); float64 [B, vocab_size].

    seeds, positions: int64 [B]. Row b depends only on (seeds[b], positions[b]).
    """
    key = mix64(mix64(seeds.to(torch.int64)) + positions.to(torch.int64))  # [B]
    tokens = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)  # [V]
    h = mix64(key[:, None] + tokens[None, :])  # [B, V]
    # The top 53 bits, centred in their bucket: exactly representable and never 0 or 1.
    return (_shr(h, 11).to(torch.float64) + 0.5) * 2.0**-53


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [B, vocab_size] (float64) from the hashed uniforms of `hash_uniform`."""
    return -torch.log(-torch.log(hash_uniform(seeds, positions, vocab_size)))


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed`: sample 0 keeps it, so n=1 and n>1 agree on it."""
    if index == 0:
        return seed
    mixed = mix64(torch.tensor([_int64(seed)]) + mix64(torch.tensor([index])))
    return int(mixed.item()) & ((1 << 63) - 1)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_token_ids: Sequence[int],
                    prompt_token_ids: Sequence[int]) -> torch.Tensor:
    """vLLM's penalties on logits [V]: repetition over prompt and output, presence and frequency over output."""
    if params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0:
        return logits  # nothing to apply: no tensor of the outputs made (a host copy for every token sampled)
    vocab_size, device = logits.shape[-1], logits.device
    out = torch.as_tensor(list(output_token_ids), dtype=torch.int64, device=device)
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        seen[out] = True
        seen[torch.as_tensor(list(prompt_token_ids), dtype=torch.int64, device=device)] = True
        scaled = torch.where(logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty)
        logits = torch.where(seen, scaled, logits)
    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        counts = torch.bincount(out, minlength=vocab_size).to(logits.dtype)  # [V]
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def allowed_mask(scaled_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The tokens min_p, then top_k, then top_p (vLLM's order) leave allowed: bool [V]. Never empty.

    scaled_logits: [V], already divided by the temperature. Ties at a top_k threshold are all kept; top_p keeps
    the most likely tokens (lowest id first among equals) until the mass before the next one reaches top_p.
    """
    vocab_size = scaled_logits.shape[-1]
    keep = scaled_logits > float("-inf")  # also drops NaN
    logits = scaled_logits.masked_fill(~keep, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        keep &= probs >= params.min_p * probs.max()
    if 0 < params.top_k < vocab_size:
        threshold = torch.topk(logits.masked_fill(~keep, float("-inf")), params.top_k).values[-1]
        keep &= logits >= threshold
    if params.top_p < 1.0:
        probs = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        order = torch.sort(probs, descending=True, stable=True).indices
        mass_before = torch.cumsum(probs[order], dim=-1) - probs[order]
        in_nucleus = torch.zeros(vocab_size, dtype=torch.bool, device=logits.device)
        in_nucleus[order] = mass_before < params.top_p
        keep &= in_nucleus
    if not keep.any():  # every logit -inf: fall back to the argmax so sampling still returns a token
        keep[torch.argmax(scaled_logits)] = True
    return keep


def adjust_logits(logits: torch.Tensor, params: SamplingParams, output_token_ids: Sequence[int] = (),
                  prompt_token_ids: Sequence[int] = (), eos_token_ids: Sequence[int] = ()) -> torch.Tensor:
    """The logits processors on one row of logits [V], in order: the request's own (allowed_token_ids, bad_words,
    logit_bias: deepinfer/logits_processors.py), vLLM's penalties, then, until `min_tokens` outputs exist, eos
    (unless ignore_eos) and the stop token ids banned. float64 [V]. A processor added here also says in
    `adjusts_logits` when it acts, so that the rows it changes leave the batched draws (`plain_greedy`,
    `plain_sampled`)."""
    logits = logits_processors.apply(logits.to(torch.float64), params, output_token_ids)
    logits = apply_penalties(logits, params, output_token_ids, prompt_token_ids)
    if len(output_token_ids) < params.min_tokens:
        banned = [*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)]
        banned = [t for t in banned if t < logits.shape[-1]]
        if banned:
            logits[torch.as_tensor(banned, dtype=torch.int64, device=logits.device)] = float("-inf")
    return logits


def adjusts_logits(params: SamplingParams, num_outputs: int) -> bool:
    """Whether `adjust_logits` may change a row's logits after `num_outputs` outputs: a processor of the request's
    own, a penalty, or a min_tokens ban still in force."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or num_outputs < params.min_tokens or logits_processors.acts(params))


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int,
           output_token_ids: Sequence[int] = (), prompt_token_ids: Sequence[int] = (),
           eos_token_ids: Sequence[int] = ()) -> int:
    """The next token of one sequence from its logits [vocab] (any float dtype).

    `position` is the index in the whole sequence (prompt included) of the token being sampled; together with
    `seed` it keys the noise. `output_token_ids` are the tokens generated so far (penalties, min_tokens),
    `prompt_token_ids` the prompt (repetition penalty); `adjust_logits` applies them, after the request's own
    processors. Greedy (temperature 0) picks the argmax, ties to the lowest id.
    """
    logits = adjust_logits(logits, params, output_token_ids, prompt_token_ids, eos_token_ids)
    if params.is_greedy:
        return int(torch.argmax(logits))  # torch.argmax returns the first of equal maxima: the lowest id
    scaled = logits * (1.0 / params.temperature)  # one rounding, the same for a scalar or a tensor factor, any device
    allowed = allowed_mask(scaled, params)
    device = logits.device
    noise = gumbel_noise(torch.tensor([_int64(seed)], device=device), torch.tensor([position], device=device),
                         logits.shape[-1])[0]
    return int(torch.argmax(scaled.masked_fill(~allowed, float("-inf")) + noise))


def plain_greedy(params: SamplingParams, num_outputs: int) -> bool:
    """Whether `sample` picks a row's next tokens as the plain argmax of its logits (`sample_plain` at temperature
    0): greedy, nothing adjusting the logits after `num_outputs` outputs, no log-probabilities asked for."""
    return params.is_greedy and not adjusts_logits(params, num_outputs) and params.logprobs is None


def plain_sampled(params: SamplingParams, num_outputs: int, vocab_size: int) -> bool:
    """Whether `sample` draws a row's next tokens from its temperature-scaled logits alone (`sample_plain` then
    draws them for many rows at once): not greedy, nothing adjusting the logits after `num_outputs` outputs, no
    min_p / top_k / top_p cut, no log-probabilities asked for."""
    p = params
    return (not p.is_greedy and not adjusts_logits(p, num_outputs) and p.min_p == 0.0
            and not 0 < p.top_k < vocab_size and p.top_p >= 1.0 and p.logprobs is None)


def sample_plain(logits: torch.Tensor, temperatures: Sequence[float], seeds: Sequence[int],
                 positions: Sequence[int], max_elements: int = 1 << 24) -> torch.Tensor:
    """`sample`'s token for each row of logits [R, V] whose params `plain_sampled` admits, at once: the argmax of
    logits * (1 / temperature) plus the row's hashed Gumbel noise (seed, position), over its tokens above -inf
    (a row with none: the argmax of its scaled logits, as `sample` falls back); a row of temperature 0 gets its
    argmax, `sample`'s greedy pick. int64 [R] on the logits' device, each row's token bitwise `sample`'s.

    float32/bfloat16 logits on a CUDA device, where a launcher serves it (Triton's JIT, or the artifact's cubins that
    a GPU target's `CompiledModel.sampling` lends), are drawn by the sampling kernel (kernels/sampling/gumbel_argmax.py),
    every row at once; others by `sample_plain_torch`, at most `max_elements` logits at a time."""
    if not logits.is_cuda:
        return sample_plain_torch(logits, temperatures, seeds, positions, max_elements)
    from dsl.transfer import host_to
    from kernels.lang import HAS_TRITON
    from kernels.launch import is_jit
    from kernels.sampling.gumbel_argmax import gumbel_argmax

    if logits.dtype not in (torch.float32, torch.bfloat16) or (is_jit() and not HAS_TRITON):
        return sample_plain_torch(logits, temperatures, seeds, positions, max_elements)
    rows = logits.shape[0]
    factors, seeds = plain_args(temperatures, seeds)
    # factors' bits, seeds and positions in one copy, each row 16-byte aligned (the cubin launcher requires it)
    host = torch.zeros(3, rows + rows % 2, dtype=torch.int64)
    host[0, :rows] = torch.tensor(factors, dtype=torch.float64).view(torch.int64)
    host[1, :rows] = torch.tensor(seeds, dtype=torch.int64)
    host[2, :rows] = torch.tensor(list(positions), dtype=torch.int64)
    args = host_to(host, logits.device)[:, :rows]
    return gumbel_argmax(logits if logits.stride(1) == 1 else logits.contiguous(), args[0].view(torch.float64), args[1],
                         args[2])


def plain_args(temperatures: Sequence[float], seeds: Sequence[int]) -> tuple[list[float], list[int]]:
    """`sample_plain`'s rows as the sampling kernel takes them: each factor 1 / temperature (0: the argmax), each seed
    as an int64."""
    return [0.0 if t == 0 else 1.0 / t for t in temperatures], [_int64(s) for s in seeds]


def sample_plain_torch(logits: torch.Tensor, temperatures: Sequence[float], seeds: Sequence[int],
                       positions: Sequence[int], max_elements: int = 1 << 24) -> torch.Tensor:
    """`sample_plain` in torch, on any device, the sampling kernel's reference: every operation elementwise or a row's
    argmax, as `sample`'s. At most `max_elements` logits at a time (the float64 noise of 129k-token rows is a GB at
    1k rows)."""
    rows, vocab = logits.shape
    device = logits.device
    greedy = [t == 0 for t in temperatures]
    out = torch.argmax(logits, dim=-1) if any(greedy) else torch.empty(rows, dtype=torch.int64, device=device)
    drawn = [r for r in range(rows) if not greedy[r]]
    step = max(1, max_elements // max(1, vocab))
    for start in range(0, len(drawn), step):
        part = drawn[start: start + step]
        index = torch.tensor(part, device=device)
        factor = torch.tensor([1.0 / temperatures[r] for r in part], dtype=torch.float64).to(device)
        scaled = logits[index].to(torch.float64) * factor[:, None]
        keep = scaled > float("-inf")  # also drops NaN
        noise = gumbel_noise(torch.tensor([_int64(seeds[r]) for r in part]).to(device),
                             torch.tensor([positions[r] for r in part]).to(device), vocab)
        picks = torch.argmax(scaled.masked_fill(~keep, float("-inf")) + noise, dim=-1)
        out[index] = torch.where(keep.any(dim=-1), picks, torch.argmax(scaled, dim=-1))
    return out


def top_logprobs(logits: torch.Tensor, token_id: int, num_logprobs: int) -> dict[int, Logprob]:
    """`token_id` and then the `num_logprobs` most likely tokens (-1: every token), with their log-probabilities and
    ranks (1 = best), in vLLM's order: the sampled token first, then the others by rank.

    As vLLM by default, these are of the model's raw distribution (log_softmax of the logits), before penalties,
    temperature and truncation.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [V]
    value = logprobs[token_id]
    out = {token_id: Logprob(logprob=float(value), rank=int((logprobs > value).sum()) + 1)}
    count = logprobs.shape[-1] if num_logprobs == -1 else min(num_logprobs, logprobs.shape[-1])
    if count > 0:
        values, ids = torch.topk(logprobs, count)
        for rank, (value, tid) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(tid, Logprob(logprob=value, rank=rank))
    return out


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: True where allowed. bitmask int32 [R, ceil(vocab_size / 32)]; bit j of word w is id
    32 * w + j (least significant bit first)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]; >> on int32 is arithmetic, the & 1 undoes it
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def as_allowed(mask: torch.Tensor | None, vocab_size: int) -> torch.Tensor | None:
    """A token constraint's mask as bool [R, vocab_size]: bool passes through, a packed int32 bitmask is unpacked."""
    if mask is None or mask.dtype == torch.bool:
        return mask
    return unpack_bitmask(mask, vocab_size)
