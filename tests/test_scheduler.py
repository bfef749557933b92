"""The scheduler on its own: FCFS, chunked prefill under the token budget, max_num_seqs, preemption by recompute,
sequences held back until ready (a grammar compiling)."""

from __future__ import annotations

import pytest

from deepinfer.engine.block_manager import BlockManager, CacheLayout
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.sequence import PLACEHOLDER, Outputs, Sequence, SequenceStatus
from deepinfer.sampling_params import SamplingParams


def make(num_blocks: int = 100, max_num_seqs: int = 4, budget: int = 16, block_size: int = 4,
         ready=None) -> Scheduler:
    layout = CacheLayout(num_slots=max_num_seqs, num_blocks=num_blocks, block_size=block_size, slot_bytes=1,
                         block_bytes=1)
    return Scheduler(BlockManager(layout), max_num_seqs, budget, ready=ready)


def seq(prompt_len: int, max_tokens: int = 8, name: str = "r") -> Sequence:
    return Sequence(name, 0, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens), seed=0,
                    max_model_len=1000)


def land(chunks, token: int = 7) -> None:
    """What the engine does with a step's result: each sampled token joins its sequence's outputs."""
    for c in chunks:
        if c.samples:
            c.seq.num_inflight -= 1
            c.seq.output_token_ids.append(token)


def plan(chunks) -> list[tuple[int, int, int, bool]]:
    return [(c.seq.seq_id, c.start, c.length, c.samples) for c in chunks]


def test_prompts_are_prefilled_in_chunks_under_the_token_budget() -> None:
    s = make(budget=4)
    a = seq(10)
    s.add(a)
    assert plan(s.schedule()) == [(a.seq_id, 0, 4, False)]
    assert plan(s.schedule()) == [(a.seq_id, 4, 4, False)]
    last = s.schedule()
    assert plan(last) == [(a.seq_id, 8, 2, True)] and a.num_inflight == 1
    land(last)
    assert plan(s.schedule()) == [(a.seq_id, 10, 1, True)]  # decode: the sampled token goes in


def test_running_sequences_come_first_then_arrivals_take_what_is_left() -> None:
    s = make(budget=6)
    a, b, c = seq(3), seq(9), seq(2)
    for x in (a, b, c):
        s.add(x)
    first = s.schedule()
    assert plan(first) == [(a.seq_id, 0, 3, True), (b.seq_id, 0, 3, False)]  # first come, first served
    land(first)
    assert plan(s.schedule()) == [(a.seq_id, 3, 1, True), (b.seq_id, 3, 5, False)]  # c waits: no budget left
    assert list(s.waiting) == [c]


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = make(max_num_seqs=2, budget=100)
    seqs = [seq(2) for _ in range(3)]
    for x in seqs:
        s.add(x)
    assert [c.seq for c in s.schedule()] == seqs[:2] and list(s.waiting) == seqs[2:]


def test_asynchronous_steps_feed_placeholders_and_stop_at_max_tokens() -> None:
    s = make()
    a = seq(3, max_tokens=2)
    s.add(a)
    first = s.schedule()  # the prompt; its token is in flight
    second = s.schedule()  # scheduled before the first step's token is seen
    assert plan(second) == [(a.seq_id, 3, 1, True)] and a.token_ids(3, 1) == [PLACEHOLDER]
    assert a.num_outputs == 2 and s.schedule() == []  # two tokens in flight: max_tokens reached
    land(first)
    assert a.token_ids(3, 1) == [7]


def test_the_newest_sequence_is_preempted_and_recomputes_first() -> None:
    s = make(num_blocks=4, budget=100)  # 16 positions of cache in all
    old, new = seq(7), seq(6)
    s.add(old)
    s.add(new)
    land(s.schedule())  # old holds 2 blocks, new 2 blocks
    assert s.block_manager.num_free_blocks == 0
    land(s.schedule())  # decodes at positions 7 and 6 fit in the blocks held
    step = s.schedule()  # old reaches position 8 and needs a third block: new is preempted
    assert plan(step) == [(old.seq_id, 8, 1, True)]
    assert new.status is SequenceStatus.WAITING and list(s.waiting) == [new]
    assert new.num_computed_tokens == 0 and new.slot is None and new.block_table == []
    assert s.num_preemptions == 1 and new.seq_id in s.freed
    land(step)
    s.finish(old)
    again = s.schedule()  # new recomputes its prompt and both outputs, then samples its next token
    assert plan(again) == [(new.seq_id, 0, 8, True)]
    assert new.token_ids(0, 8) == [*range(100, 106), 7, 7]


def test_a_sequence_preempted_with_a_token_in_flight_waits_for_it() -> None:
    s = make(num_blocks=2, budget=100)
    old, new = seq(4), seq(3)
    s.add(old)
    s.add(new)
    first = s.schedule()
    assert [c.seq for c in first] == [old, new]
    s.schedule()  # old's decode at position 4 needs a block: new, with its first token in flight, is preempted
    assert new.status is SequenceStatus.WAITING and new.num_inflight == 1
    s.finish(old)
    assert s.schedule() == []  # new's in-flight token is not known yet
    land(first)
    assert plan(s.schedule()) == [(new.seq_id, 0, 4, True)]


def test_a_sequence_alone_preempts_itself_only_when_nothing_else_can_go() -> None:
    s = make(num_blocks=1, budget=100)
    a = seq(4)
    s.add(a)
    land(s.schedule())
    assert s.schedule() == [] and a.status is SequenceStatus.WAITING  # position 4 needs a second block


def test_finishing_frees_the_cache_and_reports_the_sequence() -> None:
    s = make(num_blocks=3)
    a = seq(9)
    s.add(a)
    land(s.schedule())
    s.finish(a)
    assert a.is_finished and s.block_manager.num_free_blocks == 3 and len(s.block_manager.free_slots) == 4
    assert s.freed == [a.seq_id] and not s.has_unfinished


def test_a_sequence_not_ready_keeps_its_place_while_the_ones_behind_it_start() -> None:
    compiled: set[str] = set()
    s = make(max_num_seqs=5, budget=7, ready=lambda q: not q.request_id.startswith("slow") or q.request_id in compiled)
    slow1, a, slow2, b, c = (seq(3, name=n) for n in ("slow1", "a", "slow2", "b", "c"))
    for x in (slow1, a, slow2, b, c):
        s.add(x)
    first = s.schedule()
    assert [ch.seq for ch in first] == [a, b, c] and plan(first)[-1][2] == 1  # c takes the budget's last token
    assert list(s.waiting) == [slow1, slow2]  # held back, in arrival order
    land(first)
    compiled.add("slow2")
    d = seq(3, name="d")
    s.add(d)
    second = s.schedule()
    assert [ch.seq for ch in second] == [a, b, c, slow2]  # running first; slow1 still compiling, slow2 now goes
    assert list(s.waiting) == [slow1, d]  # the budget is spent: d waits behind slow1
    compiled.add("slow1")
    land(second)
    assert [ch.seq for ch in s.schedule()][-1] is slow1 and list(s.waiting) == [d]


def test_a_running_sequence_is_never_held_back() -> None:
    is_ready = {"value": True}
    s = make(ready=lambda q: is_ready["value"])
    a = seq(3)
    s.add(a)
    land(s.schedule())
    is_ready["value"] = False
    assert plan(s.schedule()) == [(a.seq_id, 3, 1, True)]


def test_token_ids_slice_prompt_outputs_and_the_tokens_in_flight() -> None:
    """Every range of a sequence's tokens, the prompt's, the outputs' and the in-flight placeholders, across their
    seams: what joining the prompt and the outputs would give, padded with PLACEHOLDER."""
    a = seq(5)
    a.output_token_ids += [7, 8, 9]
    a.num_inflight = 1
    known = a.prompt_token_ids + a.output_token_ids
    for start in range(0, 10):
        for length in range(0, 11 - start):
            want = known[start:start + length] + [PLACEHOLDER] * max(0, start + length - len(known))
            assert a.token_ids(start, length) == want, (start, length)


def test_outputs_read_in_place_stay_what_they_were_as_the_list_grows() -> None:
    """A step's sampling rows read their sequence's outputs in place (`Outputs`): the first `count`, then extra
    tokens, as a list of them would be, whatever the CPU side appends meanwhile."""
    items = [5, 6, 7]
    view = Outputs(items, 2).then(9)
    items += [8, 8]  # the next step's tokens landing
    assert list(view) == [5, 6, 9] and len(view) == 3 and view == [5, 6, 9] and view.tolist() == [5, 6, 9]
    assert (view[0], view[-1], view[-3], view[1:]) == (5, 9, 5, [6, 9])
    assert view + [1] == [5, 6, 9, 1] and [0] + view == [0, 5, 6, 9]
    for bad in (3, -4):
        with pytest.raises(IndexError):
            view[bad]
    with pytest.raises(ValueError, match="count 6"):
        Outputs(items, 6)
