"""The model runner's hooks and failures: allowed-token masks (the structured-outputs hook), a failing step; plain
steps' tokens fed to the next step on the device."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import EngineArgs, LLMEngine, SampleRow
from deepinfer.llm import LLM
from deepinfer.sampler import unpack_bitmask
from deepinfer.sampling_params import SamplingParams
from tests.conftest import fixture_dir

VOCAB = 512


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(fixture_dir("v41-tiny-engram")), target="cpu", max_model_len=64)


class Open:
    """The parts of a token constraint that prepare nothing: every sequence is ready at once."""

    def submit(self, seq_id: int, params: SamplingParams) -> None:
        pass

    def is_ready(self, seq_id: int) -> bool:
        return True

    def constrains(self, row: SampleRow) -> bool:
        return True

    def wait_ready(self, timeout: float) -> bool:
        return False


class EveryThird(Open):
    """Allows the ids that are 0 mod 3 (mod 6 for odd samples); records what it is told."""

    def __init__(self, packed: bool) -> None:
        self.packed = packed
        self.accepted: dict[int, list[int]] = {}
        self.finished: list[int] = []

    def allowed(self, row: SampleRow) -> torch.Tensor:
        return torch.arange(VOCAB) % (6 if row.index % 2 else 3) == 0

    def fill(self, rows: list[SampleRow], drafts: list[list[int]]) -> torch.Tensor:
        assert drafts == [[]] * len(rows)  # no drafting here
        return self.fill_next(rows, drafts)

    def fill_next(self, rows: list[SampleRow], drafts: list[list[int]]) -> torch.Tensor:
        mask = torch.stack([self.allowed(r) for r in rows])  # [rows, vocab]
        if not self.packed:
            return mask
        bits = mask.reshape(len(rows), -1, 32).long() << torch.arange(32)
        return bits.sum(-1).to(torch.int64).bitwise_and(0xFFFFFFFF).to(torch.int32)  # two's complement words

    def accept(self, rows: list[SampleRow], tokens: list[list[int]]) -> None:
        for row, (token,) in zip(rows, tokens, strict=True):
            assert bool(self.allowed(row)[token])
            self.accepted.setdefault(row.seq_id, []).append(token)

    def finish(self, seq_ids: list[int]) -> None:
        self.finished += seq_ids


def test_unpacking_a_bitmask() -> None:
    words = torch.tensor([[-1, 0], [5, -(2**31)]], dtype=torch.int32)  # 5 = ids 0 and 2; -2^31 = id 63 alone
    mask = unpack_bitmask(words, 40)
    assert mask[0].tolist() == [True] * 32 + [False] * 8
    assert torch.nonzero(mask[1]).flatten().tolist() == [0, 2]
    assert torch.nonzero(unpack_bitmask(words, 64)[1]).flatten().tolist() == [0, 2, 63]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_masks_constrain_every_sampled_token(llm: LLM, packed: bool, async_scheduling: bool) -> None:
    constraint = EveryThird(packed)
    engine = LLMEngine(llm.compiled, llm.tokenizer, EngineArgs(max_model_len=64, async_scheduling=async_scheduling),
                       llm.eos_token_ids, constraint)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=7, seed=3, ignore_eos=True)
    for length in (5, 20):
        engine.add_request({"prompt_token_ids": list(range(1, length + 1))}, params)
    outputs = list(engine.run())
    seqs = sorted(constraint.accepted)
    assert len(seqs) == 4 and sorted(constraint.finished) == seqs
    completions = [c for out in outputs for c in out.outputs]
    for c in completions:
        assert len(c.token_ids) == 7 and all(t % (6 if c.index else 3) == 0 for t in c.token_ids)
    # The hook saw each sequence's tokens in order, and nothing more: max_tokens stops are known ahead.
    assert sorted(map(tuple, constraint.accepted.values())) == sorted(tuple(c.token_ids) for c in completions)


class Poisoned:
    """A compiled model whose steps fail whenever token `poison` is among their inputs."""

    def __init__(self, compiled, poison: int) -> None:
        self.compiled, self.poison = compiled, poison
        self.config, self.graph, self.target, self.device = compiled.config, compiled.graph, compiled.target, \
            compiled.device
        self.sampling, self.capture_ahead = compiled.sampling, compiled.capture_ahead

    def step(self, batch, **kwargs):
        if any(self.poison in tokens for _, tokens in batch):
            raise RuntimeError("poisoned step")
        return self.compiled.step(batch, **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(llm: LLM, async_scheduling: bool) -> None:
    prompts = [{"prompt_token_ids": [7, 8, 9, 10]}, {"prompt_token_ids": [7, 499, 9]}, {"prompt_token_ids": [3, 4]}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    expected = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    args = EngineArgs(max_model_len=64, max_num_seqs=1, async_scheduling=async_scheduling)  # one request a step
    engine = LLMEngine(Poisoned(llm.compiled, 499), llm.tokenizer, args, llm.eos_token_ids)
    ids = [engine.add_request(p, params) for p in prompts]
    outputs = {out.request_id: out for out in engine.run()}
    good, bad, last = (outputs[i] for i in ids)
    assert bad.error == "RuntimeError: poisoned step" and bad.outputs[0].finish_reason == "error"
    assert [good.outputs[0].token_ids, last.outputs[0].token_ids] == [expected[0], expected[2]]
    assert good.error is None and last.error is None


class Verdicts(Open):
    """Ends request "0" at its third token (complete) and fails request "1" at its second; leaves "2" alone."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def fill(self, rows: list[SampleRow], drafts: list[list[int]]) -> None:
        return None

    def fill_next(self, rows: list[SampleRow], drafts: list[list[int]]) -> None:
        return None

    def accept(self, rows: list[SampleRow], tokens: list[list[int]]) -> dict[int, str | None]:
        ended = {}
        for row in rows:
            self.seen[row.seq_id] = self.seen.get(row.seq_id, 0) + 1
            if (row.request_id, self.seen[row.seq_id]) == ("0", 3):
                ended[row.seq_id] = None
            elif (row.request_id, self.seen[row.seq_id]) == ("1", 2):
                ended[row.seq_id] = "token 2 breaks the grammar"
        return ended

    def finish(self, seq_ids: list[int]) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_constraint_can_end_a_sequence_or_fail_its_request(llm: LLM, async_scheduling: bool) -> None:
    engine = LLMEngine(llm.compiled, llm.tokenizer, EngineArgs(max_model_len=64, async_scheduling=async_scheduling),
                       llm.eos_token_ids, Verdicts())
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=1, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": [5, 6, 7]}, params) for _ in range(3)]
    outputs = {out.request_id: out for out in engine.run()}
    done, failed, free = (outputs[i] for i in ids)
    assert len(done.outputs[0].token_ids) == 3 and done.outputs[0].finish_reason == "stop" and done.error is None
    assert failed.error == "token 2 breaks the grammar" and failed.outputs[0].finish_reason == "error"
    assert len(free.outputs[0].token_ids) == 6 and free.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("drafting", [False, True])
def test_sampled_rows_drawn_for_the_whole_step_are_each_rows_sample(monkeypatch, drafting: bool) -> None:
    """Rows that sample from their scaled logits alone are drawn for the whole step at once (`Sampler.picks`, and
    the drafter's drafts); their tokens are the ones sampling each row alone gives, beside greedy and top-p rows, with
    and without drafts."""
    from deepinfer.default_model import trained_model
    from deepinfer.engine import sampler
    from deepinfer.engine.spec_decode import drafter

    spec = {"num_speculative_tokens": 3} if drafting else None
    llm = LLM(trained_model(), max_num_seqs=6, speculative_config=spec)
    prompts = ["def fib(n):\n", "import os\n", "class A:\n", "x = [", "for i in range(", "# a comment\n"]
    params = [SamplingParams(max_tokens=12, temperature=t, top_p=p, seed=40 + i, ignore_eos=True)
              for i, (t, p) in enumerate([(0.7, 1.0), (1.3, 1.0), (0.0, 1.0), (0.9, 0.9), (0.4, 1.0), (1.0, 1.0)])]
    drawn = []
    sample_plain = sampler.sample_plain
    for module in (sampler, drafter):
        monkeypatch.setattr(module, "sample_plain", lambda logits, *a: drawn.append(len(logits)) or
                            sample_plain(logits, *a))
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(drawn) >= 4  # the four plain sampled requests' rows together (more with drafts)
    for module in (sampler, drafter):
        monkeypatch.setattr(module, "plain_sampled", lambda *args: False)  # every sampled row alone
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert batched == alone


def test_plain_steps_feed_their_tokens_to_the_next_step_on_the_device(llm: LLM, monkeypatch) -> None:
    """A plain step leaves its tokens on the device, and the next step's placeholders take them there (forced here: on
    the cpu the tokens are on the host at once, so every placeholder is said to be still in flight). The outputs are
    those of waiting for every step's tokens, with a request whose sampling reads its outputs (a penalty: its steps
    wait) running beside the plain ones for a while. The LLM's structured outputs constrain none of these rows, so
    they hold no step back."""
    from deepinfer.engine.sampler import SampledIds

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (4, 9, 2)]
    params = [SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=12, seed=5, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=4, seed=6, presence_penalty=0.5, ignore_eos=True)]

    def run(async_scheduling: bool, compiled) -> list[list[int]]:
        engine = LLMEngine(compiled, llm.tokenizer, EngineArgs(max_model_len=64, async_scheduling=async_scheduling),
                           llm.eos_token_ids, llm.engine.constraint)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        outputs = {out.request_id: out for out in engine.run()}
        return [outputs[i].outputs[0].token_ids for i in ids]

    class Recorded:
        """The compiled model, recording each step's fed rows."""

        def __init__(self, compiled) -> None:
            self.compiled, self.fed = compiled, []
            for name in ("config", "graph", "target", "device", "sampling", "capture_ahead"):
                setattr(self, name, getattr(compiled, name))

        def step(self, batch, **kwargs):
            self.fed.append(kwargs.get("fed"))
            return self.compiled.step(batch, **kwargs)

    waited = run(False, llm.compiled)
    monkeypatch.setattr(SampledIds, "ready", lambda self: False)
    recorded = Recorded(llm.compiled)
    assert run(True, recorded) == waited
    fed = [f for f in recorded.fed if f is not None]
    assert len(fed) >= 5 and max(len(rows) for _, rows, _ in fed) == 2  # the two plain requests' rows, fed together
    assert any(f is None for f in recorded.fed[3:6])  # the penalized request's steps wait for its token
