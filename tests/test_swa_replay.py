"""Sliding-window bounded replay (`swa_replay_tokens`): exact when it keeps the whole prompt, equal bit for bit to a
plain masked reference when it does not, the engine's replay positions, and the settings it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import deepinfer
from deepinfer.config import DeepseekV41Config
from deepinfer.engine.engine_args import EngineArgs
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence
from deepinfer.llm import LLM
from deepinfer.models import DeepseekV41Flash
from deepinfer.replay import boundary_layer, check_replay_tokens
from deepinfer.sampling_params import SamplingParams
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from dsl.ops import OPS, invariant_references
from dsl.ops.cache_view import CacheView
from tests.conftest import DISCRETE, SMOOTH, fixture_dir, oracle, rel_l2

FIXTURES = SMOOTH + DISCRETE
_REPLAY: dict = {}


def replay_compiled(name: str):
    if name not in _REPLAY:
        _REPLAY[name] = deepinfer.compile(DeepseekV41Flash.from_pretrained(fixture_dir(name)), replay=True)
    return _REPLAY[name]


def prompt(name: str) -> list[int]:
    return oracle(name)["input_ids"][0].tolist()  # 48 tokens


def replayed_logits(compiled, ids: list[int], keep: int, chunks: list[int], decode: list[int],
                    batch_invariant: bool) -> torch.Tensor:
    """Logits after each chunk's last token, then after each decode token, the decoder layers of the prefill run
    from position len(ids) - keep on (the engine's replay_from)."""
    state, out, start = compiled.new_sequence(), [], 0
    state.replay_from = max(0, len(ids) - keep)
    for n in chunks:
        out.append(compiled.step([(state, ids[start: start + n])], batch_invariant=batch_invariant))
        start += n
    state.replay_from = 0
    for t in decode:
        out.append(compiled.step([(state, [t])], batch_invariant=batch_invariant))
    return torch.cat(out)


@pytest.mark.parametrize("name", FIXTURES)
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_replay_keeping_the_whole_prompt_is_exact(name: str, batch_invariant: bool, compiled_fixture) -> None:
    ids, decode = prompt(name), [5, 9]
    for keep, chunks in [(48, [48]), (200, [10, 30, 8])]:
        replay = replayed_logits(replay_compiled(name), ids, keep, chunks, decode, batch_invariant)
        exact = replayed_logits(compiled_fixture(name), ids, len(ids), chunks, decode, batch_invariant)
        assert torch.equal(replay, exact), (keep, chunks)


def masked_reference(compiled, ids: list[int], keep: int, decode: list[int]) -> torch.Tensor:
    """Bounded replay written the simplest way: the exact graph over every row, one chunk, each decoder layer's
    window view cut to the positions from len(ids) - keep on (DeepSeek's "mask" mode). Rows before that compute
    values nothing reads; the compressors run on their inputs as in the exact forward. Logits after the prompt's last
    token, then after each decode token (batch-invariant kernels, so rows do not depend on their neighbours; the
    test also checks replay against it through the plain references' attention, on the smooth fixtures)."""
    cfg, first = compiled.config, len(ids) - keep
    decoder = boundary_layer(cfg)
    append = OPS["kv_window_append"].reference

    def cut(kv: torch.Tensor, *, layer: int, window: int, ctx: ForwardContext) -> CacheView:
        view = append(kv, layer=layer, window=window, ctx=ctx)
        if layer < decoder:
            return view
        keys = [k[p >= first] for k, p in zip(view.keys, view.positions, strict=True)]  # [L_i, D]
        return CacheView(keys, [p[p >= first] for p in view.positions], first=[max(f, first) for f in view.first])

    state, out = SequenceState(), []
    for tokens in [ids] + [[t] for t in decode]:
        ctx = ForwardContext([state], [len(tokens)], logit_rows=torch.tensor([len(tokens) - 1]))
        out.append(interpret(compiled.graph, {"input_ids": torch.tensor(tokens)}, compiled.params, ctx,
                             {**invariant_references(), "kv_window_append": cut})["logits"])
        ctx.commit()
    return torch.cat(out)


@pytest.mark.parametrize("name", FIXTURES)
def test_replay_equals_the_masked_reference_bit_for_bit(name: str, compiled_fixture) -> None:
    ids, decode = prompt(name), [7, 3]
    references = {keep: masked_reference(compiled_fixture(name), ids, keep, decode) for keep in (9, 20)}
    for keep, chunks in [(9, [48]), (20, [13, 1, 20, 14]), (20, [5, 40, 3])]:
        replay = replayed_logits(replay_compiled(name), ids, keep, chunks, decode, batch_invariant=True)
        kept = [i for i in range(len(chunks)) if sum(chunks[: i + 1]) > len(ids) - keep]  # chunks that keep rows
        assert torch.isnan(replay[: kept[0]]).all() and not torch.isnan(replay[kept[0]:]).any()
        assert torch.equal(replay[len(chunks) - 1:], references[keep]), (keep, chunks)
    exact = replayed_logits(compiled_fixture(name), ids, 48, [48], decode, batch_invariant=True)
    assert not torch.equal(references[9], exact)  # replay is not the exact forward
    if name in SMOOTH:  # the other attention (the references'): its rounding differs, within what these allow
        plain = replayed_logits(replay_compiled(name), ids, 9, [13, 1, 20, 14], decode, batch_invariant=False)
        assert rel_l2(plain[3:].numpy(), references[9].numpy()) < 1e-5
        assert rel_l2(exact.numpy(), references[9].numpy()) > 1e-3


def test_a_batch_replays_each_sequence_from_its_own_position() -> None:
    compiled, ids = replay_compiled("v41-tiny"), prompt("v41-tiny")
    alone = [replayed_logits(compiled, ids[:n], keep, [n], [], True) for n, keep in [(48, 12), (30, 30), (41, 9)]]
    states = [compiled.new_sequence() for _ in range(3)]
    for state, (n, keep) in zip(states, [(48, 12), (30, 30), (41, 9)], strict=True):
        state.replay_from = n - keep
    batch = compiled.step([(states[0], ids[:48]), (states[1], ids[:30]), (states[2], ids[:41])], batch_invariant=True)
    assert torch.equal(batch, torch.cat(alone))


def test_the_engine_replays_the_last_tokens_of_every_prefill() -> None:
    llm = LLM(str(fixture_dir("v41-tiny")), max_num_seqs=2, swa_replay_tokens=9)
    seq = Sequence("0", 0, list(range(3, 43)), SamplingParams(max_tokens=5), 0, 200)
    replay_from = llm.engine._replay_from
    assert replay_from(ScheduledChunk(seq, 0, 16, False)) == 31  # a first chunk: the prompt's last 9 run
    assert replay_from(ScheduledChunk(seq, 32, 8, True)) == 31  # the last chunk
    seq.output_token_ids = [5, 6]
    assert replay_from(ScheduledChunk(seq, 0, 20, False)) == 31  # a recompute after preemption: the same position
    assert replay_from(ScheduledChunk(seq, 41, 1, True)) == 31  # a decode row: all of it runs
    assert replay_from(ScheduledChunk(seq, 41, 3, True, [7, 8])) == 31  # verification: all of it
    exact = LLM(str(fixture_dir("v41-tiny")), max_num_seqs=2)
    assert exact.engine._replay_from(ScheduledChunk(seq, 0, 20, False)) == 0


@pytest.mark.parametrize("budget", [512, 7])
def test_llm_replay_matches_the_masked_reference_however_the_prompt_is_chunked(budget: int, compiled_fixture) -> None:
    ids = prompt("v41-smooth")
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0)
    llm = LLM(str(fixture_dir("v41-smooth")), max_num_seqs=2, swa_replay_tokens=14, max_num_batched_tokens=budget)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    reference = masked_reference(compiled_fixture("v41-smooth"), ids, 14, out.token_ids[:-1])
    assert out.token_ids == reference.argmax(-1).tolist()
    chosen = torch.log_softmax(reference, -1)[torch.arange(4), out.token_ids]
    assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)] == pytest.approx(
        chosen.tolist(), rel=1e-6)
    whole = LLM(str(fixture_dir("v41-smooth")), max_num_seqs=2, swa_replay_tokens=48)
    exact = LLM(str(fixture_dir("v41-smooth")), max_num_seqs=2)
    assert llm.engine.prefix_cache is not None  # replay runs with prefix caching (tests/test_prefix_caching_replay.py)
    assert ([o.outputs[0].token_ids for o in whole.generate({"prompt_token_ids": ids}, params, use_tqdm=False)]
            == [o.outputs[0].token_ids for o in exact.generate({"prompt_token_ids": ids}, params, use_tqdm=False)])


def test_bad_replay_settings_are_refused_with_their_names() -> None:
    for bad in (0, -3, 1.5, True, "140"):
        with pytest.raises(ValueError, match="swa_replay_tokens must be an integer >= 1 or None"):
            EngineArgs(swa_replay_tokens=bad)
    with pytest.raises(ValueError, match=r"swa_replay_tokens=8 is below sliding_window \+ num_speculative_tokens "
                                         r"\+ 1 = 8 \+ 0 \+ 1 = 9"):
        LLM(str(fixture_dir("v41-tiny")), swa_replay_tokens=8)
    cfg = DeepseekV41Config.from_pretrained(fixture_dir("v41-tiny"))
    with pytest.raises(ValueError, match=r"sliding_window \+ num_speculative_tokens \+ 1 = 8 \+ 5 \+ 1 = 14"):
        check_replay_tokens(cfg, 13, 5)
    check_replay_tokens(cfg, 14, 5)
    assert boundary_layer(cfg) == 5


def test_models_bounded_replay_cannot_run_are_refused() -> None:
    cfg = DeepseekV41Config.from_pretrained(fixture_dir("v41-tiny-engram"))
    late = dataclasses.replace(cfg, engram_layer_ids=(1, 5))
    with pytest.raises(ValueError, match=r"Engram layers \[5\] are at or after the first decoder layer \(5\)"):
        boundary_layer(late)
    sources = dataclasses.replace(cfg, kv_source_layer_ids=(2, 5, 6), index_source_layer_ids=(2, 5, 6))
    with pytest.raises(ValueError, match=r"KV sources \[6\] come after the first decoder layer \(5\)"):
        boundary_layer(sources)
    encoder_only = dataclasses.replace(cfg, compress_ratios=(0, 0, 2, 2, 2, 2, 2, 2), kv_source_layer_ids=(2,),
                                       index_source_layer_ids=(2,), candidate_source_layer_id=2)
    with pytest.raises(ValueError, match="swa_replay_tokens needs decoder layers"):
        boundary_layer(encoder_only)


def test_replay_is_refused_where_it_cannot_run() -> None:
    from deepinfer.engine import LLMEngine

    llm = LLM(str(fixture_dir("v41-tiny")), max_num_seqs=2)
    with pytest.raises(ValueError, match=r"compiled for bounded replay: deepinfer.compile\(model, replay=True\)"):
        LLMEngine(llm.compiled, llm.tokenizer, EngineArgs(swa_replay_tokens=20), llm.eos_token_ids)
    replay = LLM(str(fixture_dir("v41-tiny")), max_num_seqs=2, swa_replay_tokens=20)
    out = replay.generate({"prompt_token_ids": prompt("v41-tiny")}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    assert "prompt_logprobs are not computed with swa_replay_tokens=20" in out[0].error


def test_drafting_leaves_replayed_outputs_unchanged() -> None:
    # The embedded checkpoint's DSpark features come from layers 4, 6 and 7, around its first decoder layer (5): the
    # boundary takes layer 4's to the kept rows, so the draft layers' main keys cover the kept positions.
    from deepinfer.default_model import trained_model

    model, ids = trained_model(), list(range(400, 600))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(model, max_num_seqs=1, swa_replay_tokens=134)
    drafting = LLM(model, max_num_seqs=1, swa_replay_tokens=134,
                   speculative_config={"method": "dspark", "num_speculative_tokens": 5})
    a, b = (llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0] for llm in (plain, drafting))
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert sum(b.metrics.drafts_accepted) > 0
    with pytest.raises(ValueError, match=r"swa_replay_tokens=133 is below .* = 128 \+ 5 \+ 1 = 134"):
        LLM(model, swa_replay_tokens=133, speculative_config={"method": "dspark", "num_speculative_tokens": 5})
