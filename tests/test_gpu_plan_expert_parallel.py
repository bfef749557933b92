"""Expert parallelism on the sm90 plan, on the H200: `RankLLM` as the one NCCL rank (world size 1) against `LLM` on
the same plan, bitwise (tokens, logprobs, seeds), batch-invariant mode, greedy and seeded; the MoE nodes run through
the exchange, outside the CUDA graphs. The CPU's 2-rank check of the same path: tests/test_plan_expert_parallel.py.
Several GPUs: `python bench/ep_h200.py --part gpus --target sm90`."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import default_checkpoint
from deepinfer.distributed import ranks
from deepinfer.distributed.rank_llm import RankLLM
from graphs.executor import EXCHANGED
from graphs.lockstep import LockstepRuntime

pytestmark = pytest.mark.gpu

PROMPTS = ["def fib(n):", "import os", {"prompt_token_ids": list(range(100, 160))}, "class Stack:"]
PARAMS = [SamplingParams(max_tokens=12, temperature=0, logprobs=3),
          SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2),
          SamplingParams(max_tokens=9, temperature=0.9),
          SamplingParams(max_tokens=4, temperature=0)]


@pytest.fixture
def nccl_rank_of_one():
    ranks.join_alone("cuda")
    yield
    ranks.leave()


def test_one_nccl_rank_on_sm90_gives_the_plain_plan_s_outputs(nccl_rank_of_one) -> None:
    want = LLM(default_checkpoint(), target="sm90", max_num_seqs=4, batch_invariant=True).generate(
        PROMPTS, PARAMS, use_tqdm=False)
    rank = RankLLM(default_checkpoint(), target="sm90", max_num_seqs=4, batch_invariant=True)
    assert isinstance(rank.compiled.runtime, LockstepRuntime)
    got = rank.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert [dataclasses.replace(g, metrics=None) for g in got] == [dataclasses.replace(w, metrics=None) for w in want]
    executor = rank.compiled.runtime.inner.executors()[0]
    assert executor.uncaptured == EXCHANGED and executor.parallel_experts is not None
    assert rank.compiled.runtime.num_rounds > 0
