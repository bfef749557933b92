"""Prefix caching with bounded replay (`swa_replay_tokens`): which snapshots serve which sequence, and through the
engine, outputs and every sampled logits row bitwise those without the cache under the same setting (batch-invariant
mode), over request mixes that share prefixes, with eviction and preemption, n > 1 and drafting; a recompute after a
preemption resumes from the cache and replays from its own snapshot."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer.default_model import default_config, random_weights
from deepinfer.engine.block_manager import BlockManager, CacheLayout
from deepinfer.engine.sequence import Sequence
from deepinfer.llm import LLM
from deepinfer.models import DeepseekV41Flash
from deepinfer.sampling_params import SamplingParams
from tests.conftest import fixture_dir
from tests.test_prefix_caching import VOCAB, _check_same, _engine, _generate, mixes


def _seq(prompt: list[int]) -> Sequence:
    return Sequence("r", 0, prompt, SamplingParams(max_tokens=4), seed=0, max_model_len=1000)


def _manager(keep: int) -> BlockManager:
    layout = CacheLayout(num_slots=3, num_blocks=40, block_size=4, slot_bytes=1, block_bytes=1, num_snapshots=4,
                         snapshot_interval=400)
    return BlockManager(layout, enable_prefix_caching=True, swa_replay_tokens=keep)


def _take(manager: BlockManager, seq: Sequence, at: int) -> None:
    """`seq`'s prompt computed, with a snapshot taken at `at` and registered, its blocks registered."""
    manager.allocate(seq, len(seq.prompt_token_ids))
    seq.num_computed_tokens = len(seq.prompt_token_ids)
    planned = manager.prefix_cache.plan_snapshot(seq, at - 1, at, {at})
    assert planned is not None and planned[0] == at
    manager.prefix_cache.commit_snapshot(seq, planned, taken=True)
    manager.cache_blocks(seq)


def test_a_snapshot_serves_a_sequence_replaying_after_it_or_from_the_same_position() -> None:
    manager, stem = _manager(keep=12), list(range(100, 160))
    owner = _seq(stem[:40])  # its replay starts at 28
    _take(manager, owner, 32)  # past 28: tagged 28
    cache = manager.prefix_cache
    assert cache.snapshot_of[cache.keys(owner, 8)[-1]].keys() == {28}
    assert manager.lookup(_seq(stem[:40])).num_tokens == 32  # the same prompt: the same replay position
    assert manager.lookup(_seq(stem[:36] + [1] * 10)).num_tokens == 32  # replays from 34: never sees a window at 32
    assert manager.lookup(_seq(stem[:34] + [2, 3])) is None  # replays from 24: the windows from 24 to 32 differ
    early = _seq(stem[:20])  # its replay starts at 8: a snapshot at 16 tagged 8
    _take(manager, early, 16)
    assert manager.lookup(_seq(stem[:34] + [2, 3])).num_tokens == 16  # at or before 24: any tag serves
    assert manager.lookup(_seq(stem[:17] + [4, 5])) is None  # replays from 7, not from 8
    # where a running sequence's snapshot would serve a waiting one: the shared end, or the waiting one's replay
    # position's block when that comes first and their positions differ
    assert cache.shared_with(owner, [_seq(stem[:36] + [9] * 12)]) == {36}  # it replays from 36
    assert cache.shared_with(owner, [_seq(stem[:34] + [2, 3])]) == {24}
    assert cache.shared_with(owner, [_seq(stem[:40])]) == {36}


def test_the_snapshot_a_waiting_sequence_asks_for_is_one_that_serves_it() -> None:
    manager, stem = _manager(keep=12), list(range(100, 160))
    owner, waiting = _seq(stem[:44]), _seq(stem[:41] + [7])  # replays from 32 and from 30; they share 40
    manager.allocate(owner, 8)
    owner.num_computed_tokens = 8
    cache = manager.prefix_cache
    assert cache.ask(owner, waiting, 0) and owner.snapshots_asked.keys() == {28}  # at or before 30
    assert cache.waits_for(waiting, 0) and not cache.waits_for(waiting, 28)
    assert not cache.waits_for(_seq(stem[:29] + [1]), 0)  # replays from 18: a snapshot at 28 tagged None
    cache.release(owner)
    assert not cache.pending


@pytest.fixture(scope="module")
def llm() -> LLM:
    """The engram fixture (window 8) compiled for bounded replay."""
    return LLM(str(fixture_dir("v41-tiny-engram")), target="cpu", max_model_len=256, swa_replay_tokens=9)


def _compare(llm: LLM, mix, **args) -> tuple:
    """Generate `mix` with prefix caching off and on (the same other settings); check they agree bit for bit, and
    return the caching engine and its outputs."""
    plain = _generate(_engine(llm, **args), mix)
    engine = _engine(llm, enable_prefix_caching=True, **args)
    cached = _generate(engine, mix)
    _check_same(plain[0], cached[0], plain[1], cached[1])
    cache = engine.prefix_cache
    assert not cache.pending and len(cache.free_snapshots) + len(cache.snapshot_lru) == engine.layout.num_snapshots
    assert engine.scheduler.block_manager.num_free_blocks == engine.layout.num_blocks
    return engine, cached[0]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=mixes(), keep=st.sampled_from([9, 20, 45]), async_scheduling=st.booleans(),
       tokens=st.sampled_from([32, 512]), budget=st.sampled_from([None, 16]), num_snapshots=st.integers(1, 3))
def test_replay_with_prefix_caching_gives_the_same_outputs_and_logits(llm: LLM, mix, keep: int,
                                                                      async_scheduling: bool, tokens: int,
                                                                      budget: int | None, num_snapshots: int) -> None:
    _compare(llm, mix, swa_replay_tokens=keep, async_scheduling=async_scheduling, max_num_batched_tokens=tokens,
             max_num_seqs=4, budget_blocks=budget, num_snapshots=num_snapshots)


def test_shared_prefixes_hit_under_replay(llm: LLM) -> None:
    """A 64-token stem with tails of 2 to 30 tokens, keep 20: the two sequences that replay from the same position
    share the stem's end, the others resume at or before their own replay positions; n = 2 samples share theirs."""
    rng = random.Random(5)
    stem = [rng.randrange(VOCAB) for _ in range(64)]
    tails = [30, 2, 30, 9, 17]
    mix = [(stem + [rng.randrange(VOCAB) for _ in range(t)],
            SamplingParams(n=2 if i == 3 else 1, temperature=0.8, seed=i, max_tokens=6, logprobs=2, ignore_eos=True))
           for i, t in enumerate(tails)]
    engine, outs = _compare(llm, mix, swa_replay_tokens=20, max_num_seqs=4, max_num_batched_tokens=512)
    cached = [o.num_cached_tokens for o in outs]
    # the first computes the stem; the third replays from 74 as the first does: 64, its stem's end (it waited for
    # the first's snapshot there); the others from 46, 53 and 61: the block at or before it (or later for the samples)
    assert cached[0] == 0 and cached[2] == 64 and all(0 < c <= 64 for c in cached[1:])
    assert cached[1] == 32 and cached[4] == 48  # replaying from 46 and 61: 46 // 16 * 16, 61 // 16 * 16
    assert engine.prefix_cache.num_hit_tokens >= sum(cached) + 48  # the second sample resumes at least at 48 too


def test_a_recompute_after_preemption_is_a_hit_plus_a_bounded_replay(llm: LLM) -> None:
    """Two 70-token prompts, 60 tokens each, 16 blocks of 16 beside 3 snapshots: the newer is preempted once the
    blocks run out, and recomputes from its own snapshot at 64, past its replay position (61), which preemption does
    not move: the snapshot's decoder windows are those it computes itself. Its outputs are those it has without any
    preemption."""
    rng = random.Random(3)
    mix = [([rng.randrange(VOCAB) for _ in range(70)], SamplingParams(max_tokens=60, ignore_eos=True))
           for _ in range(2)]
    rows: list[tuple[int, int, int, bool]] = []  # (seq_id, start, tokens, restored) of every row the forward ran
    engine = _engine(llm, enable_prefix_caching=True, swa_replay_tokens=9, budget_blocks=16, max_num_seqs=2,
                     num_snapshots=3)
    forward = engine.runner._forward

    def recording(batch, step_rows, *rest):
        rows.extend((r.seq_id, r.start, len(r.token_ids), r.restore is not None) for r in step_rows)
        return forward(batch, step_rows, *rest)

    engine.runner._forward = recording
    cached, logits = _generate(engine, mix)
    assert engine.num_preemptions == 1 and engine.layout.snapshot_interval == 64
    resumed = [(i, row[0], row[1]) for i, row in enumerate(rows) if row[3]]
    assert [r[2] for r in resumed] == [64]  # the prompts share no block: the one hit is the recompute's
    # from the hit on, each position up to the last one fed ran once: 65 of the 129 it had
    first, seq = resumed[0][:2]
    assert sum(n for s, _, n, _ in rows[first:] if s == seq) == 129 - 64
    assert all(o.num_cached_tokens == 0 for o in cached)  # the first start of each found nothing
    alone = _generate(_engine(llm, swa_replay_tokens=9, max_num_seqs=2), mix)  # room for both: no preemption
    _check_same(alone[0], cached, alone[1], logits)  # the logits of every token too, the recompute's last among them


@pytest.fixture(scope="module")
def drafting() -> LLM:
    """The random-weight model with a window of 16, so that replay with 4 drafts keeps as few as 21 tokens."""
    config = default_config().replace(sliding_window=16)
    model = DeepseekV41Flash(config, random_weights(config))
    return LLM(model, max_num_seqs=4, swa_replay_tokens=24,
               speculative_config={"method": "dspark", "num_speculative_tokens": 4})


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mix=mixes(max_prompt=90, max_tokens=12), budget=st.sampled_from([None, 14]))
def test_replay_with_prefix_caching_and_drafting_gives_the_same_outputs(drafting: LLM, mix, budget) -> None:
    args = {"swa_replay_tokens": 24, "num_drafts": 4, "budget_blocks": budget, "max_num_seqs": 4,
            "max_model_len": 128}
    plain = _generate(_engine(drafting, **args), mix)
    cached = _generate(_engine(drafting, enable_prefix_caching=True, interval=16, **args), mix)
    _check_same(plain[0], cached[0], plain[1], cached[1])


def test_drafting_sequences_resume_from_the_cache_under_replay(drafting: LLM) -> None:
    """Two samples of an 80-token prompt and a 72-token prompt sharing its first 70: hits and accepted drafts, the
    outputs and logits those without the cache."""
    rng = random.Random(1)
    stem = [rng.randrange(VOCAB) for _ in range(90)]
    mix = [(stem[:80], SamplingParams(n=2, max_tokens=12, ignore_eos=True)),
           (stem[:70] + [3, 4], SamplingParams(max_tokens=12, temperature=0.8, seed=2, ignore_eos=True))]
    args = {"swa_replay_tokens": 24, "num_drafts": 4, "max_num_seqs": 4, "max_model_len": 128}
    plain = _generate(_engine(drafting, **args), mix)
    engine = _engine(drafting, enable_prefix_caching=True, interval=16, **args)
    cached = _generate(engine, mix)
    _check_same(plain[0], cached[0], plain[1], cached[1])
    # the second request replays from 48: it resumes there; the second sample at the prompt's last boundary, 64
    assert [o.num_cached_tokens for o in cached[0]] == [0, 48] and engine.prefix_cache.num_hit_tokens == 48 + 64
    assert all(sum(o.metrics.drafts_accepted) > 0 for o in cached[0])
