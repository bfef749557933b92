"""DSpark drafting: the budget allocation against a plain reference, the draft layers' forward, taking tokens back,
and lossless speculative decoding (greedy and seeded) through `LLM`."""

from __future__ import annotations

import random

import pytest
import torch

import deepinfer
from deepinfer import LLM, SamplingParams
from deepinfer.default_model import default_model
from deepinfer.dspark import DraftHead, allocate_by_confidence, allocate_static, block_states, block_tokens
from deepinfer.engine import SpeculativeConfig
from dsl.cache import CacheSpec, PagedCache
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from dsl.ops import invariant_references


def plain_allocation(confidences: list[list[float]], available: list[int], budget: int) -> list[int]:
    """The rule written out: one token each; the rest to the available (request, position) pairs by cumulative
    product of confidences, highest first, ties to the lower flat index."""
    k = len(confidences[0]) if confidences else 0
    pairs = []
    for i, row in enumerate(confidences):
        product = 1.0
        for j, c in enumerate(row):
            product *= min(max(c, 0.0), 1.0)
            if j < available[i]:
                pairs.append((-product, i * k + j, i))
    pairs.sort()
    counts = [0] * len(confidences)
    for _, _, i in pairs[: max(0, budget - len(confidences))]:
        counts[i] += 1
    return counts


@pytest.mark.parametrize("seed", range(40))
def test_allocation_matches_the_plain_reference(seed: int) -> None:
    rng = random.Random(seed)
    requests, k = rng.randint(1, 40), rng.randint(1, 6)
    # Coarse values make ties common; some requests are fresh (no drafts) and some near their max_tokens.
    levels = [0.0, 0.25, 0.5, 0.75, 1.0] if seed % 2 else None
    conf = torch.tensor([[rng.choice(levels) if levels else rng.random() for _ in range(k)] for _ in range(requests)],
                        dtype=torch.float32)
    available = torch.tensor([rng.choice([0, k, k, rng.randint(0, k)]) for _ in range(requests)])
    for budget in (requests, requests + 1, rng.randint(requests, requests * (k + 1)), requests * (k + 1), 10**6):
        got = allocate_by_confidence(conf, available, budget)
        assert got.tolist() == plain_allocation(conf.tolist(), available.tolist(), budget), (budget, conf, available)
        assert int(got.sum()) <= max(0, budget - requests) and bool((got <= available).all())


def test_allocation_corner_cases() -> None:
    conf = torch.tensor([[0.9, 0.9, 0.9], [0.2, 0.9, 0.9], [1.0, 1.0, 1.0]])
    full = torch.tensor([3, 3, 3])
    assert allocate_by_confidence(conf, full, 3).tolist() == [0, 0, 0]  # one token per request: no drafts
    assert allocate_by_confidence(conf, full, 2).tolist() == [0, 0, 0]  # less than that: still none
    assert allocate_by_confidence(conf, full, 5).tolist() == [0, 0, 2]  # the surest drafts first
    assert allocate_by_confidence(conf, full, 7).tolist() == [1, 0, 3]
    tied = torch.full((2, 2), 0.5)
    assert allocate_by_confidence(tied, torch.tensor([2, 2]), 3).tolist() == [1, 0]  # ties to the lower index
    assert allocate_by_confidence(conf, full, 100).tolist() == [3, 3, 3]
    assert allocate_by_confidence(conf, torch.tensor([0, 3, 1]), 100).tolist() == [0, 3, 1]  # fresh request: none
    assert allocate_static(2, full, 100).tolist() == [2, 2, 2]
    assert allocate_static(2, full, 6).tolist() == [2, 1, 0]  # the budget runs out in request order
    assert allocate_static(5, torch.tensor([1, 0, 4]), 100).tolist() == [1, 0, 4]


def test_speculative_config_errors_name_the_field() -> None:
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict({"method": "dspark"}).num_speculative_tokens == 5
    for bad, field in [({"method": "eagle"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"schedule": "fastest"}, "schedule"), ({"verify_budget": 0}, "verify_budget"),
                       ({"confidence_temperature": 0}, "confidence_temperature"), ({"draft_len": 3}, "draft_len"),
                       ({"draft_lengths": "short"}, "draft_lengths"), ({"confidence": "oracle"}, "confidence")]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_dict(bad)


def test_adaptive_draft_lengths_follow_the_last_verification() -> None:
    fixed, adaptive = SpeculativeConfig(), SpeculativeConfig(draft_lengths="adaptive")
    assert fixed.next_length(2, verified=3, accepted=0) == 5  # fixed: always num_speculative_tokens
    assert adaptive.next_length(None, verified=0, accepted=0) == 5  # nothing verified yet: the full block
    assert adaptive.next_length(5, verified=4, accepted=0) == 2  # two more than it accepted
    assert adaptive.next_length(2, verified=2, accepted=2) == 4
    assert adaptive.next_length(4, verified=4, accepted=4) == 5  # at most num_speculative_tokens
    assert adaptive.next_length(3, verified=0, accepted=0) == 3  # a step without drafts keeps its block


@pytest.fixture(scope="module")
def compiled():
    return deepinfer.compile(default_model(), "cpu", drafting=True)


def test_draft_forward_reads_the_main_keys_of_the_sequence(compiled) -> None:
    """Drafting after incremental steps equals drafting from states built off one full forward's main keys."""
    cfg = compiled.config
    ids = torch.randint(0, 5000, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = SequenceState()
    keys = interpret(compiled.graph, {"input_ids": torch.tensor(ids)}, compiled.params,
                     ForwardContext([whole], [len(ids)]), invariant_references())["draft_keys"]
    assert keys.shape == (150, cfg.num_nextn_predict_layers, cfg.head_dim)
    state = compiled.new_sequence()
    for chunk in (ids[:100], ids[100:101], ids[101:140]):
        compiled.step([(state, chunk)], batch_invariant=True)  # chunked as the full forward was not: invariant
    block = block_tokens(ids[140], cfg)
    hidden, logits = compiled.draft([(state, block)])
    (built,) = block_states(keys, [140], cfg)
    hidden2, logits2 = compiled.draft([(built, block)])
    assert torch.equal(hidden, hidden2) and torch.equal(logits, logits2)
    assert state.num_tokens == 140  # drafting leaves the sequence as it was
    head = DraftHead(compiled.params, cfg)
    emb, markov = head.markov(torch.tensor(block))
    conf = head.confidence(hidden, emb)
    assert markov.shape == logits.shape and bool(((conf >= 0) & (conf <= 1)).all())


def test_the_scheduler_feeds_decoding_sequences_the_drafts_the_plan_gives(compiled) -> None:
    """The scheduler asks DSpark's plan (static here: in request order, within the verification budget) and feeds
    each decoding sequence a prefix of its proposal after its last token, never past its max_tokens; a preempted
    sequence drops its proposal."""
    from deepinfer.engine.block_manager import BlockManager, CacheLayout
    from deepinfer.engine.scheduler import Scheduler
    from deepinfer.engine.sequence import Sequence
    from deepinfer.engine.spec_decode import DSparkSpeculator
    from deepinfer.engine.speculator import Proposal

    config = SpeculativeConfig(num_speculative_tokens=3, schedule="static", verify_budget=7)
    layout = CacheLayout(num_slots=4, num_blocks=100, block_size=4, slot_bytes=1, block_bytes=1)
    scheduler = Scheduler(BlockManager(layout), 4, 16, DSparkSpeculator(compiled, config, (1,), True))
    seqs = [Sequence(str(i), 0, [5, 6, 7], SamplingParams(max_tokens=m), 0, 1000) for i, m in enumerate((8, 3, 8))]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule()
    assert [(c.length, c.drafts) for c in first] == [(3, [])] * 3  # prefills verify nothing
    for c in first:  # what the engine does with the step's result
        c.seq.num_inflight -= 1
        c.seq.output_token_ids.append(9)
        c.seq.proposal = Proposal([11, 12, 13], [0.9, 0.8, 0.7])
    chunks = scheduler.schedule()
    # 7 tokens: one each, then 3 drafts for the first, 1 for the second (its last token but one), none left
    assert [(c.start, c.length, c.drafts) for c in chunks] == [(3, 4, [11, 12, 13]), (3, 2, [11]), (3, 1, [])]
    scheduler.preempt(seqs[2])
    assert seqs[2].proposal is None and seqs[0].proposal is not None


@pytest.mark.parametrize("paged", [False, True])
def test_taking_tokens_back_leaves_the_caches_as_before(compiled, paged: bool) -> None:
    """A sequence that ran extra tokens and took them back continues exactly as one that never ran them: across
    window wrap-around, compressor groups (ratio 2) and Engram history."""
    spare = 5
    ids = torch.randint(0, 5000, (170,), generator=torch.Generator().manual_seed(1)).tolist()
    cache = None
    if paged:
        spec = CacheSpec.from_graph(compiled.graph, spare=spare)
        cache = PagedCache(spec, num_slots=2, num_blocks=64, block_size=16)

    def fresh(slot: int) -> SequenceState:
        state = SequenceState(cache=cache, slot=slot)
        state.block_table = list(range(slot * 32, slot * 32 + 32)) if paged else []
        return state

    plain, taken = fresh(0), fresh(1)
    compiled.step([(plain, ids[:130])])
    compiled.step([(taken, ids[:130])])
    for start in range(130, 163, 3):
        compiled.step([(taken, ids[start:start + 3] + [7, 8, 9, 10])], batch_invariant=True)  # 4 wrong tokens
        compiled.rollback(taken, start + 3, spare)
        compiled.step([(plain, ids[start:start + 3])], batch_invariant=True)
    a = compiled.step([(plain, ids[163:170])], all_logits=True, batch_invariant=True)
    b = compiled.step([(taken, ids[163:170])], all_logits=True, batch_invariant=True)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="taken back"):
        compiled.rollback(taken, taken.num_tokens - spare - 1, spare)


@pytest.fixture(scope="module")
def llms():
    """The random-weight default: drafts are mostly rejected, which exercises taking tokens back."""
    return {"off": LLM(default_model(), max_num_seqs=4),
            "confidence": LLM(default_model(), max_num_seqs=4,
                              speculative_config={"method": "dspark", "num_speculative_tokens": 5}),
            "static": LLM(default_model(), max_num_seqs=4,
                          speculative_config={"num_speculative_tokens": 3, "schedule": "static", "verify_budget": 6}),
            "adaptive": LLM(default_model(), max_num_seqs=4,
                            speculative_config={"num_speculative_tokens": 5, "draft_lengths": "adaptive"})}


PROMPTS = ["def fib(n):", {"prompt_token_ids": list(range(100, 235))}]  # the second wraps the 128-token windows


@pytest.mark.parametrize(("params", "schedule"), [
    (SamplingParams(max_tokens=8, temperature=0), "confidence"),
    (SamplingParams(max_tokens=8, temperature=0.8, seed=3), "confidence"),
    (SamplingParams(max_tokens=8, temperature=0.8, seed=5), "static"),
    (SamplingParams(max_tokens=6, temperature=1.0, top_k=50, seed=11, presence_penalty=0.5, logprobs=2), "confidence"),
    (SamplingParams(max_tokens=8, temperature=0), "adaptive"),  # random drafts: blocks shrink to 2 (ragged)
    (SamplingParams(max_tokens=8, temperature=0.8, seed=3), "adaptive"),
], ids=["greedy", "seeded", "static", "penalties", "adaptive-greedy", "adaptive-seeded"])
def test_drafting_is_lossless(llms, params: SamplingParams, schedule: str) -> None:
    want = llms["off"].generate(PROMPTS, params, use_tqdm=False)
    got = llms[schedule].generate(PROMPTS, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text and g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if params.logprobs is not None:
            assert [sorted(s) for s in g.outputs[0].logprobs] == [sorted(s) for s in w.outputs[0].logprobs]
        m = g.metrics
        assert m.drafts_verified and all(0 <= a <= v for a, v in zip(m.drafts_accepted, m.drafts_verified))
        assert m.mean_accepted_length >= 1.0
        assert len(m.drafts_verified) <= (3 if schedule == "static" else 5)


@pytest.fixture(scope="module")
def trained_llms():
    from deepinfer.default_model import trained_model

    return (LLM(trained_model(), max_num_seqs=4),
            LLM(trained_model(), max_num_seqs=4, speculative_config={"method": "dspark", "num_speculative_tokens": 5}))


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0),
                                    SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, seed=1)],
                         ids=["greedy", "seeded"])
def test_drafting_on_the_trained_checkpoint_is_lossless_and_accepts(trained_llms, params: SamplingParams) -> None:
    """The trained drafter is right often enough to matter, and drafting changes no token."""
    check_lossless_and_accepts(*trained_llms, params)  # measured 1.8 to 3.4 tokens per verifying step


def test_adaptive_draft_blocks_on_the_trained_checkpoint_are_lossless_and_accept(trained_llms) -> None:
    """Draft blocks sized per request (ragged draft passes) change no token either, and still accept."""
    from deepinfer.default_model import trained_model

    adaptive = LLM(trained_model(), max_num_seqs=4, speculative_config={"num_speculative_tokens": 5,
                                                                        "draft_lengths": "adaptive"})
    check_lossless_and_accepts(trained_llms[0], adaptive, SamplingParams(max_tokens=24, temperature=0))


def test_draft_probability_confidence_on_the_trained_checkpoint_is_lossless_and_accepts(trained_llms) -> None:
    """Confidences from the draft distribution (not the head) only change which drafts are verified: no token."""
    from deepinfer.default_model import trained_model

    draft = LLM(trained_model(), max_num_seqs=4, speculative_config={"num_speculative_tokens": 5,
                                                                     "confidence": "draft"})
    for params in (SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=16, temperature=0.7,
                                                                                 seed=2)):
        check_lossless_and_accepts(trained_llms[0], draft, params)


def tokens_per_verifying_step(outputs) -> float:
    """Accepted drafts plus one, per verifying step, over requests' outputs."""
    steps = sum(o.metrics.drafts_verified[0] for o in outputs if o.metrics.drafts_verified)
    return (steps + sum(sum(o.metrics.drafts_accepted) for o in outputs)) / steps


def check_lossless_and_accepts(off: LLM, on: LLM, params: SamplingParams, at_least: float = 1.3) -> None:
    """`on` (drafting) gives `off`'s tokens on three code prompts, with more than `at_least` tokens per step."""
    prompts = ["def fib(n):\n", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n"]
    want, got = off.generate(prompts, params, use_tqdm=False), on.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert tokens_per_verifying_step(got) > at_least


@pytest.mark.parametrize("confidence", ["head", "draft"])
def test_greedy_fast_paths_match_the_sampler(compiled, confidence: str) -> None:
    """Rows that sample plain greedily propose and verify on the argmax read back once: the same drafts and
    confidences as the per-token sampler's path, and the same verified tokens, for matching and mismatching drafts."""
    from deepinfer.engine.sampler import Draw, Sampler, SampleRow
    from deepinfer.engine.spec_decode.drafter import Drafter
    from deepinfer.engine.spec_decode.verifier import verify
    from deepinfer.sampler import plain_greedy

    drafter = Drafter(compiled, SpeculativeConfig(num_speculative_tokens=4, confidence=confidence), (1,),
                      batch_invariant=True)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for n in (30, 7, 55):
        state = compiled.new_sequence()
        prompt = torch.randint(4, 5000, (n,), generator=gen).tolist()
        compiled.step([(state, prompt)], batch_invariant=True)
        row = SampleRow(len(rows), str(len(rows)), 0, SamplingParams(temperature=0), 0, prompt, [prompt[-1]], 0)
        rows.append((state, row, [prompt[-1]]))
    assert all(plain_greedy(s.params, len(outputs)) for _, s, outputs in rows)
    fast = drafter.propose(rows)
    vocab = compiled.config.vocab_size
    slow = drafter.propose(rows, fill_next=lambda samples, drafts: torch.ones(len(samples), vocab, dtype=torch.bool))
    # (a constraint allowing every token: the per-token sampler's path, masks applied)
    assert [p.tokens for p in fast] == [p.tokens for p in slow]
    fast_c, slow_c = torch.tensor([p.confidences for p in fast]), torch.tensor([p.confidences for p in slow])
    assert torch.allclose(fast_c, slow_c, rtol=1e-6, atol=0) and ((fast_c > 0) & (fast_c <= 1)).all()
    if confidence == "head":
        assert torch.equal(fast_c, slow_c)
    logits = torch.randn(5, 64, generator=gen)
    target = torch.argmax(logits, dim=-1).tolist()
    penalised = SampleRow(9, "9", 0, SamplingParams(temperature=0, presence_penalty=1e-9), 0, [1], [], 0)
    sampler, state = Sampler((1,)), rows[0][0]
    for drafts in (target[:4], target[:2] + [target[2] + 1, target[3]], [target[0] + 1] * 4, []):
        fast = verify(sampler, logits, None, [Draw(rows[0][1], [5], drafts, 0, state)])
        slow = verify(sampler, logits, None, [Draw(penalised, [5], drafts, 0, state)])  # a penalty that changes none
        assert fast == slow  # the argmax read back once, and the per-token sampler


@pytest.mark.parametrize("confidence", ["head", "draft"])
def test_sampled_drafts_for_every_row_at_once_match_the_sampler(compiled, confidence: str) -> None:
    """Rows that sample from their scaled logits alone (beside a greedy one) draft every position of every row at
    once (`_plain_drafts`): the drafts and confidences of the per-token sampler's path."""
    from deepinfer.engine.sampler import SampleRow
    from deepinfer.engine.spec_decode.drafter import Drafter
    from deepinfer.sampler import plain_sampled

    drafter = Drafter(compiled, SpeculativeConfig(num_speculative_tokens=4, confidence=confidence), (1,),
                      batch_invariant=True)
    gen = torch.Generator().manual_seed(5)
    rows = []
    for n, temperature in ((30, 0.8), (7, 0.0), (55, 1.3), (12, 0.5)):
        state = compiled.new_sequence()
        prompt = torch.randint(4, 5000, (n,), generator=gen).tolist()
        compiled.step([(state, prompt)], batch_invariant=True)
        params = SamplingParams(temperature=temperature, seed=len(rows))
        rows.append((state, SampleRow(len(rows), str(len(rows)), 0, params, 9 + len(rows), prompt, [prompt[-1]], 0),
                     [prompt[-1]]))
    vocab = compiled.config.vocab_size
    assert [plain_sampled(s.params, 1, vocab) for _, s, _ in rows] == [True, False, True, True]  # and 1 greedy
    for lengths in (None, [4, 2, 1, 3]):
        fast = drafter.propose(rows, lengths=lengths)
        slow = drafter.propose(rows, fill_next=lambda samples, drafts: torch.ones(len(samples), vocab,
                                                                                  dtype=torch.bool), lengths=lengths)
        assert [p.tokens for p in fast] == [p.tokens for p in slow]
        assert torch.allclose(torch.tensor(sum((p.confidences for p in fast), [])),
                              torch.tensor(sum((p.confidences for p in slow), [])), rtol=1e-6, atol=0)
