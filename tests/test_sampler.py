"""The sampler: greedy, truncation of the support, penalties, and the hashed noise of seeded sampling."""

from __future__ import annotations

import pytest
import torch

from deepinfer.sampler import (allowed_mask, derive_seed, gumbel_noise, hash_uniform, mix64, plain_sampled, sample,
                               sample_plain, top_logprobs)
from deepinfer.sampling_params import SamplingParams

_M = (1 << 64) - 1


def splitmix64_reference(state: int) -> int:
    """splitmix64's output for `state`, in exact Python integers (Vigna's reference, one step)."""
    z = (state + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def test_reference_matches_the_published_splitmix64_sequence() -> None:
    # The first outputs of splitmix64 seeded with 1234567 (the state advances by the golden gamma per output).
    expected = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431]
    states = [(1234567 + i * 0x9E3779B97F4A7C15) & _M for i in range(4)]
    assert [splitmix64_reference(s) for s in states] == expected


def test_mix64_in_int64_is_exact_uint64_arithmetic() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**63), 2**63 - 1, (4096,), dtype=torch.int64, generator=gen)
    x[:4] = torch.tensor([0, -1, -(2**63), 2**63 - 1])
    got = [v & _M for v in mix64(x).tolist()]
    assert got == [splitmix64_reference(v & _M) for v in x.tolist()]


def test_uniforms_are_strictly_inside_the_unit_interval_and_uniform() -> None:
    u = hash_uniform(torch.arange(8), torch.arange(8) * 1000, 50000)  # [8, 50000]
    assert u.dtype == torch.float64 and bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.002
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert float((hist - 0.1).abs().max()) < 0.003


def test_noise_row_depends_only_on_its_own_seed_and_position() -> None:
    seeds, positions = torch.tensor([3, 11, 3, -5]), torch.tensor([7, 7, 8, 0])
    batch = gumbel_noise(seeds, positions, 1000)  # [4, 1000]
    for b in range(4):
        alone = gumbel_noise(seeds[b:b + 1], positions[b:b + 1], 1000)[0]
        assert torch.equal(batch[b], alone)
    assert not torch.equal(batch[0], batch[2])  # same seed, next position: fresh noise
    assert not torch.equal(batch[0], batch[1])


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    logits = torch.tensor([0.5, 2.0, -1.0, 2.0, 1.9])
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, greedy, seed=1, position=0) == 1
    assert sample(logits, greedy, seed=99, position=5) == 1  # noise plays no part
    logits = torch.randn(129280, generator=torch.Generator().manual_seed(1))
    assert sample(logits, greedy, seed=0, position=0) == int(torch.argmax(logits))


def _support(logits: torch.Tensor, params: SamplingParams, draws: int = 400) -> set[int]:
    return {sample(logits, params, seed=s, position=3) for s in range(draws)}


def test_top_k_restricts_the_support() -> None:
    logits = torch.tensor([1.0, 3.0, 0.5, 2.9, 2.8, -1.0])
    assert _support(logits, SamplingParams(top_k=2, temperature=5.0)) == {1, 3}
    assert _support(logits, SamplingParams(top_k=-1, temperature=5.0)) == set(range(6))


def test_top_p_keeps_the_smallest_set_reaching_the_mass() -> None:
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log()
    # Sorted: 0.4, 0.3 (mass 0.7), 0.15 (mass 0.85), 0.1 (0.95), 0.05.
    assert set(allowed_mask(logits.double(), SamplingParams(top_p=0.7)).nonzero().flatten().tolist()) == {1, 2}
    assert set(allowed_mask(logits.double(), SamplingParams(top_p=0.71)).nonzero().flatten().tolist()) == {1, 2, 3}
    assert _support(logits, SamplingParams(top_p=0.8)) == {1, 2, 3}


def test_min_p_drops_tokens_below_the_scaled_maximum() -> None:
    probs = torch.tensor([0.5, 0.26, 0.2, 0.04])
    mask = allowed_mask(probs.log().double(), SamplingParams(min_p=0.5))  # threshold 0.25
    assert mask.tolist() == [True, True, False, False]
    assert _support(probs.log(), SamplingParams(min_p=0.5)) == {0, 1}


def test_truncations_compose_in_vllms_order() -> None:
    logits = torch.tensor([2.0, 1.9, 1.8, 0.0, -5.0]).double()
    mask = allowed_mask(logits, SamplingParams(min_p=0.05, top_k=4, top_p=0.5))
    assert mask.tolist() == [True, True, False, False, False]


def test_seeded_sampling_depends_only_on_seed_position_and_logits() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(129280, generator=gen)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    first = [sample(logits, params, seed=42, position=p) for p in range(10)]
    for _ in range(3):  # unrelated work in between changes nothing: no hidden generator state
        sample(torch.randn(129280, generator=gen), params, seed=7, position=1)
    assert [sample(logits.clone(), params, seed=42, position=p) for p in range(10)] == first
    assert len(set(first)) > 1  # positions draw fresh noise
    assert [sample(logits, params, seed=43, position=p) for p in range(10)] != first


def test_sampling_frequencies_follow_the_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, 2.0, -1.0, 0.5, 1.5])
    temperature, draws = 0.7, 6000
    params = SamplingParams(temperature=temperature)
    counts = torch.zeros(6)
    for s in range(draws):
        counts[sample(logits, params, seed=s, position=17)] += 1
    expected = torch.softmax(logits / temperature, dim=-1) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 35.9, (chi2, counts.tolist(), expected.tolist())  # 5 degrees of freedom, p = 1e-6


def test_frequencies_over_positions_of_one_seed_follow_the_softmax() -> None:
    logits = torch.tensor([0.3, -0.2, 1.1, 0.0])
    draws = 4000
    counts = torch.zeros(4)
    for p in range(draws):
        counts[sample(logits, SamplingParams(), seed=123, position=p)] += 1
    expected = torch.softmax(logits, dim=-1) * draws
    assert float(((counts - expected) ** 2 / expected).sum()) < 30.7  # 3 degrees of freedom, p = 1e-6


def test_penalties_follow_vllm() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.6])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=4.0)
    assert sample(logits, greedy, 0, 0, output_token_ids=[0]) == 2  # 2.0 / 4 = 0.5 < 1.0
    assert sample(logits, greedy, 0, 0, prompt_token_ids=[0, 2]) == 3  # prompt tokens count too
    presence = SamplingParams(temperature=0.0, presence_penalty=1.5)
    assert sample(logits, presence, 0, 0, output_token_ids=[0, 0, 0]) == 2  # 2.0 - 1.5 = 0.5
    frequency = SamplingParams(temperature=0.0, frequency_penalty=0.4)
    assert sample(logits, frequency, 0, 0, output_token_ids=[0, 0]) == 0  # 2.0 - 0.8 = 1.2 > 1.0
    assert sample(logits, frequency, 0, 0, output_token_ids=[0, 0, 0]) == 2  # 2.0 - 1.2 = 0.8 < 1.0


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([0.0, 5.0, 4.0, 3.0])
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, params, 0, 0, output_token_ids=[3], eos_token_ids=[1]) == 3
    assert sample(logits, params, 0, 0, output_token_ids=[3, 3], eos_token_ids=[1]) == 1
    ignore = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits, ignore, 0, 0, output_token_ids=[], eos_token_ids=[1]) == 1


def test_derived_seeds_keep_sample_zero_and_differ_per_index() -> None:
    assert derive_seed(77, 0) == 77
    derived = {derive_seed(77, i) for i in range(1, 50)}
    assert len(derived) == 49 and 77 not in derived
    assert all(0 <= s < 2**63 for s in derived)


@pytest.mark.parametrize("num_logprobs", [0, 1, 3])
def test_top_logprobs_rank_and_include_the_sampled_token(num_logprobs: int) -> None:
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    out = top_logprobs(logits, token_id=3, num_logprobs=num_logprobs)
    full = torch.log_softmax(logits, dim=-1)
    assert set(out) == {1, 4, 2}.intersection(sorted([1, 4, 2], key=lambda t: -logits[t])[:num_logprobs]) | {3}
    assert out[3].rank == 5 and abs(out[3].logprob - float(full[3])) < 1e-6
    if num_logprobs:
        assert out[1].rank == 1 and abs(out[1].logprob - float(full[1])) < 1e-6


def test_many_rows_sampled_at_once_are_each_rows_sample() -> None:
    """`sample_plain` over a batch (in parts smaller than the batch, too) picks each row's `sample` token bitwise:
    temperatures that round differently, tokens at -inf and NaN, rows with nothing allowed (all -inf; -inf and a
    NaN), where `sample` falls back to the argmax."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(13, 300, generator=gen) * 4
    logits[2, :150] = float("-inf")
    logits[5, 7] = float("nan")
    logits[9] = float("-inf")
    logits[11] = float("-inf")
    logits[11, 42] = float("nan")
    temperatures = [0.3, 0.7, 1.0, 1.3, 0.05, 2.0, 0.9, 0.6, 1.1, 0.8, 0.4, 1.7, 0.7]
    seeds, positions = [3 * i - 5 for i in range(13)], [11 * i for i in range(13)]
    for max_elements in (1 << 24, 4 * 300):
        got = sample_plain(logits, temperatures, seeds, positions, max_elements=max_elements).tolist()
        for r in range(13):
            params = SamplingParams(temperature=temperatures[r])
            assert plain_sampled(params, 0, 300)
            assert got[r] == sample(logits[r], params, seeds[r], positions[r]), r
    assert got[9] == 0 and got[11] == 42


def test_only_rows_sample_draws_from_the_scaled_logits_alone_go_batched() -> None:
    plain = SamplingParams(temperature=0.8)
    assert plain_sampled(plain, 0, 100)
    for other in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_p=0.9),
                  SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=0.8, min_p=0.1),
                  SamplingParams(temperature=0.8, presence_penalty=0.5), SamplingParams(temperature=0.8, logprobs=1)):
        assert not plain_sampled(other, 0, 100)
    assert plain_sampled(SamplingParams(temperature=0.8, top_k=100), 0, 100)  # a cut past the vocabulary: none
    assert not plain_sampled(SamplingParams(temperature=0.8, min_tokens=3), 2, 100)
    assert plain_sampled(SamplingParams(temperature=0.8, min_tokens=3), 3, 100)


def test_rows_of_temperature_zero_get_the_greedy_pick() -> None:
    """`sample_plain` among sampled rows: a row of temperature 0 gets `sample`'s greedy token (its argmax, ties to the
    lowest id, the first NaN), the sampled rows their draws as alone."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 200, generator=gen) * 3
    logits[1, [17, 150]] = 20.0
    logits[3, 60] = float("nan")
    temperatures, seeds, positions = [0.8, 0.0, 1.2, 0.0, 0.0, 0.5], [9, 1, 2, 3, 4, 5], [30, 31, 32, 33, 34, 35]
    got = sample_plain(logits, temperatures, seeds, positions).tolist()
    for r in range(6):
        assert got[r] == sample(logits[r], SamplingParams(temperature=temperatures[r]), seeds[r], positions[r]), r
    assert got[1] == 17 and got[3] == 60
    assert sample_plain(logits[[0, 2, 5]], [0.8, 1.2, 0.5], [9, 2, 5], [30, 32, 35]).tolist() == got[0:3:2] + got[5:]
