"""Bounded replay on sm90 (the plan runtime with CUDA graphs), on the GPU: keeping every prompt token gives the exact
compile's logits bit for bit; a truncated replay drops the same rows as the cpu target's replay on the GPU and agrees
with it within bf16 products' rounding; and the engine with `swa_replay_tokens` gives the same tokens with prefix
caching on and off. Under Triton's interpreter: tests/test_plan_replay.py."""

from __future__ import annotations

import pytest
import torch

from deepinfer.default_model import TRAINED_CHECKPOINT
from tests.conftest import rel_l2
from tests.test_plan_replay import run as run_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def models():
    import deepinfer
    from deepinfer.models import DeepseekV41Flash

    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)
    return (deepinfer.compile(model, target="sm90", replay=True), deepinfer.compile(model, target="sm90"),
            deepinfer.compile(model, target="cpu", device="cuda", replay=True))


def run(compiled, prompts: list[list[int]], keeps: list[int], chunk: int, decode: int) -> torch.Tensor:
    return run_steps(compiled, prompts, keeps, chunk, decode, pooled=False).cpu()


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (300, 170, 45)]


def test_sm90_replay_is_exact_keeping_every_token_and_the_cpu_targets_replay_truncated(models) -> None:
    replay, exact, cpu = models
    ids = prompts()
    whole = run(exact, ids, [400] * 3, 128, 6)
    assert torch.equal(run(replay, ids, [400] * 3, 128, 6), whole)
    keeps = [140, 140, 140]
    got, want = run(replay, ids, keeps, 128, 6), run(cpu, ids, keeps, 128, 6)
    kept = ~torch.isnan(want[:, 0])
    assert torch.equal(kept, ~torch.isnan(got[:, 0])) and not kept.all()
    assert rel_l2(got[kept].numpy(), want[kept].numpy()) < 5e-2  # bf16 products against fp32 references
    assert rel_l2(got[kept].numpy(), whole[kept].numpy()) > 0  # the replay did cut something


def test_the_engine_replays_on_sm90_alike_with_prefix_caching_on_and_off() -> None:
    from deepinfer import LLM, SamplingParams

    shared = list(range(100, 400))
    reqs = [{"prompt_token_ids": shared + [5 + i] * (3 + i)} for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0)
    outs = [LLM(TRAINED_CHECKPOINT, target="sm90", swa_replay_tokens=140, enable_prefix_caching=on)
            .generate(reqs, params, use_tqdm=False) for on in (True, False)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]
    assert sum(o.num_cached_tokens for o in outs[0]) > 0
