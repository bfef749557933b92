"""Expert parallelism with data-parallel attention on the cpu target (gloo ranks spawned by `LLM`): the outputs are
bitwise those of one process (tokens, logprobs, seeds, request ids), greedy and seeded, drafting on and off; a bad
request fails alone on whichever rank runs it; a rank that dies or raises ends the call with an error naming it."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli import main
from deepinfer.default_model import default_checkpoint
from deepinfer.distributed import ranks
from deepinfer.distributed.rank_llm import RankLLM
from deepinfer.distributed.spawned_llm import RankFailedError
from deepinfer.outputs import RequestOutput
from dsl.ops.moe import invariant_moe_experts
from graphs.lockstep import LockstepRuntime
from graphs.runtime import FatalRuntimeError
from kernels.moe.expert_parallel import ExpertParallelExperts
from tests.conftest import fixture_dir

DSPARK = {"method": "dspark", "num_speculative_tokens": 3}
# Five requests over two ranks: of unequal lengths, so one rank idles (serving the other's experts) while the other
# runs; greedy, seeded, and seeds drawn by the engine; logprobs compare the logits.
PROMPTS = ["def fib(n):", "import os", {"prompt_token_ids": list(range(100, 160))}, "class Stack:", "for i in"]
PARAMS = [SamplingParams(max_tokens=6, temperature=0, logprobs=3),
          SamplingParams(max_tokens=3, temperature=0.8, seed=3, logprobs=2),
          SamplingParams(max_tokens=8, temperature=0.9),
          SamplingParams(max_tokens=2, temperature=0),
          SamplingParams(max_tokens=5, temperature=1.0, top_k=40)]


def same(got: list[RequestOutput], want: list[RequestOutput]) -> None:
    """Everything but the wall-clock metrics, bitwise."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert dataclasses.replace(g, metrics=None) == dataclasses.replace(w, metrics=None)


@pytest.fixture(scope="module")
def embedded():
    """One process and two ranks over the embedded checkpoint (6 experts: 3 a rank; its draft layers' 4: 2 a rank)."""
    two = LLM(default_checkpoint(), expert_parallel_size=2, max_num_seqs=4)
    yield LLM(default_checkpoint(), max_num_seqs=4), two
    two.close()


def test_two_ranks_give_one_process_s_outputs(embedded) -> None:
    one, two = embedded
    for _ in range(2):  # a second call continues the request ids and the drawn seeds alike
        want = one.generate(PROMPTS, PARAMS, use_tqdm=False)
        same(two.generate(PROMPTS, PARAMS, use_tqdm=False), want)
    assert [o.request_id for o in want] == ["5", "6", "7", "8", "9"]
    assert two.max_model_len == one.max_model_len


def test_a_bad_request_fails_alone_on_any_rank(embedded) -> None:
    one, two = embedded
    # bad on rank 1 (a token id out of range), rank 0 (parameters of the wrong type), rank 1 (an empty prompt)
    prompts = [PROMPTS[0], {"prompt_token_ids": [1, 10**6]}, PROMPTS[1], "", PROMPTS[3]]
    params = [PARAMS[0], PARAMS[1], "not params", PARAMS[3], PARAMS[4]]
    want = one.generate(prompts, params, use_tqdm=False)
    got = two.generate(prompts, params, use_tqdm=False)
    same(got, want)
    assert [o.error is not None for o in got] == [False, True, True, True, False]
    assert got[0].outputs[0].token_ids and got[4].outputs[0].token_ids


def test_fewer_requests_than_ranks(embedded) -> None:
    one, two = embedded
    same(two.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False), one.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))
    assert two.generate([], use_tqdm=False) == []


def test_drafting_on_two_ranks_gives_one_process_s_outputs() -> None:
    """DSpark's draft layers' experts are split too; the draft forwards are agreed on like the main ones."""
    params = [SamplingParams(max_tokens=10, temperature=0, logprobs=2), SamplingParams(max_tokens=8, temperature=0.7,
                                                                                     seed=1),
              SamplingParams(max_tokens=6, temperature=0)]
    prompts = PROMPTS[:3]
    want = LLM(default_checkpoint(), max_num_seqs=4, speculative_config=DSPARK).generate(prompts, params,
                                                                                        use_tqdm=False)
    two = LLM(default_checkpoint(), expert_parallel_size=2, max_num_seqs=4, speculative_config=DSPARK)
    try:
        got = two.generate(prompts, params, use_tqdm=False)
    finally:
        two.close()
    assert any(o.metrics.drafts_verified for o in got)
    for g, w in zip(got, want, strict=True):
        assert g.outputs == w.outputs and g.seed == w.seed


def test_four_ranks_give_one_process_s_outputs() -> None:
    """A small fixture with Engram layers whose tokens each pick all 4 experts: one a rank, every token's four
    outputs summed from four ranks in the reference's order; the ranks keep the Engram tables in host memory."""
    path = fixture_dir("v41-smooth-engram")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 9, 2, 12)]
    want = LLM(path, max_num_seqs=4, engram_storage="device").generate(prompts, PARAMS, use_tqdm=False)
    four = LLM(path, expert_parallel_size=4, max_num_seqs=4, engram_storage="host")
    try:
        same(four.generate(prompts, PARAMS, use_tqdm=False), want)
    finally:
        four.close()


def test_a_killed_rank_ends_the_call_with_an_error_naming_it() -> None:
    two = LLM(fixture_dir("v41-tiny"), expert_parallel_size=2)
    errors: list[BaseException] = []
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)

    def call() -> None:
        try:
            two.generate([{"prompt_token_ids": [3, 4]}] * 4, long, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            errors.append(e)

    worker = threading.Thread(target=call)
    worker.start()
    time.sleep(2.0)  # the ranks are in their forwards' all-to-alls by now
    os.kill(two._ranks[1].pid, signal.SIGKILL)
    worker.join(timeout=60)
    assert not worker.is_alive(), "the call hangs after a rank died"
    assert len(errors) == 1 and isinstance(errors[0], RankFailedError)
    assert "rank 1 died (killed by SIGKILL)" in str(errors[0])
    with pytest.raises(RankFailedError, match="failed earlier: rank 1 died"):
        two.generate(["x"], use_tqdm=False)


def test_a_rank_that_raises_ends_the_call_with_an_error_naming_it() -> None:
    """Each rank compiles its own share: a fixture without draft layers asked to draft fails on every rank."""
    missing = "KeyError: \"weight 'mtp.0.main_proj.weight' is missing\""
    with pytest.raises(RankFailedError) as failed:
        LLM(fixture_dir("v41-tiny"), expert_parallel_size=2, speculative_config=DSPARK)
    assert str(failed.value) == f"rank 0 failed: {missing}; rank 1 failed: {missing}"


def test_experts_that_do_not_split_evenly_are_refused() -> None:
    with pytest.raises(ValueError, match=r"6 routed experts do not split evenly over expert_parallel_size=4"):
        LLM(default_checkpoint(), expert_parallel_size=4)


def test_data_parallel_size_must_equal_expert_parallel_size() -> None:
    with pytest.raises(ValueError, match="data_parallel_size=1 must equal expert_parallel_size=2"):
        LLM(default_checkpoint(), expert_parallel_size=2, data_parallel_size=1)


@pytest.fixture
def rank_of_one():
    """This process as the one rank of a gloo group, for the distributed path at world size 1."""
    ranks.join_alone("cpu")
    yield
    ranks.leave()


def test_one_rank_runs_the_distributed_path_bitwise(rank_of_one) -> None:
    rank = RankLLM(default_checkpoint(), max_num_seqs=4)
    assert isinstance(rank.compiled.runtime, LockstepRuntime)
    same(rank.generate(PROMPTS, PARAMS, use_tqdm=False),
         LLM(default_checkpoint(), max_num_seqs=4).generate(PROMPTS, PARAMS, use_tqdm=False))
    assert rank.compiled.runtime.num_rounds > 0


def test_a_failing_forward_on_a_rank_ends_the_call_rather_than_its_requests(rank_of_one) -> None:
    """One device fails the step's requests and goes on; a rank cannot (the others wait in its all-to-alls)."""
    rank = RankLLM(fixture_dir("v41-tiny"))
    params = rank.compiled.runtime.params
    params["layers.0.ffn.experts.w1.weight"] = torch.zeros(1, 1, 1, dtype=torch.uint8)  # a forward cannot run on it
    with pytest.raises(FatalRuntimeError, match="rank 0: a forward failed"):
        rank.generate(["x"], SamplingParams(max_tokens=2), use_tqdm=False)


def test_routed_outputs_are_summed_in_ascending_expert_order(rank_of_one) -> None:
    """Bitwise the reference's sum, whose order matters: the slots' own order rounds otherwise."""
    g = torch.Generator().manual_seed(0)
    n, d, inner, num_experts, k = 64, 32, 16, 8, 4
    x = torch.randn(n, d, generator=g) * 10
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n)])  # [N, k], unsorted
    weights = torch.rand(n, k, generator=g)
    w1, w3 = torch.randn(num_experts, inner, d, generator=g), torch.randn(num_experts, inner, d, generator=g)
    w2 = torch.randn(num_experts, d, inner, generator=g)
    want = invariant_moe_experts(x, weights, experts, w1, w2, w3, limit=7.0)
    got = ExpertParallelExperts(None, invariant=True)(x, weights, experts, w1, w2, w3, limit=7.0)
    assert torch.equal(got, want)
    by_slot = torch.zeros_like(x)  # the same pairs added in slot order round otherwise: the order is what is tested
    for j in range(k):
        by_slot += invariant_moe_experts(x, weights[:, j:j + 1], experts[:, j:j + 1], w1, w2, w3, limit=7.0)
    assert torch.allclose(by_slot, want, rtol=1e-5, atol=1e-3) and not torch.equal(by_slot, want)


def test_torchrun_runs_the_command_line_on_two_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """`torchrun --nproc-per-node 2 -m deepinfer generate ...` prints what one process prints (rank 0 alone)."""
    flags = ["generate", "def fib(n):", "import os", "class A:", "--max-tokens", "5", "--temperature", "0.8",
             "--no-progress"]
    assert main(flags) == 0
    want = capsys.readouterr().out
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "deepinfer", *flags]
    got = subprocess.run(torchrun, capture_output=True, text=True, timeout=300, check=False)
    assert got.returncode == 0, got.stderr
    assert got.stdout == want and want.count("Completion:") == 3


def test_bounded_replay_on_two_ranks_gives_one_process_s_outputs() -> None:
    """A rank whose forward lies wholly before bounded replay's boundary (a long prompt's first chunks) computes no
    decoder layer, yet its experts still serve the other rank's decoder layers."""
    prompts = [{"prompt_token_ids": list(range(100, 400))}, "def fib(n):"]  # rank 0 the long one, rank 1 the other
    params = [SamplingParams(max_tokens=4, temperature=0, logprobs=2)] * 2
    kwargs = dict(max_num_seqs=4, max_num_batched_tokens=64, swa_replay_tokens=140, enable_prefix_caching=False)
    want = LLM(default_checkpoint(), **kwargs).generate(prompts, params, use_tqdm=False)
    two = LLM(default_checkpoint(), expert_parallel_size=2, **kwargs)
    try:
        same(two.generate(prompts, params, use_tqdm=False), want)
    finally:
        two.close()
