"""Expert parallelism on a GPU target's plan, run on the CPU (the plan runtime with Triton's interpreter, gloo ranks):
two ranks, each its own sequences (data-parallel attention) and half the routed experts, give bitwise the logits
and tokens (greedy and seeded) of one process running the same plan over every sequence, in batch-invariant mode.
The sequences are of unequal lengths, so one rank runs idle passes that serve the other's experts. Also: the MoE
nodes stay out of the CUDA graphs' segments only under expert parallelism, the AOT builder records the exchange's
launches only when asked, and a forward that fails ends the job with an error naming the rank. On the H200:
tests/test_gpu_plan_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.distributed import ranks
from deepinfer.models import DeepseekV41Flash
from deepinfer.models.weights import ExpertShard
from deepinfer.sampler import sample
from deepinfer.sampling_params import SamplingParams
from dsl.passes import run_passes
from graphs.aot import record_launches
from graphs.capture import find_segments
from graphs.compiled_model import CompiledModel
from graphs.executor import EXCHANGED
from graphs.lockstep import LockstepRuntime
from graphs.passes import make_plan
from graphs.plan_runtime import PlanRuntime
from graphs.runtime import FatalRuntimeError
from tests.conftest import fixture_dir

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs where there is no GPU")

FIXTURE = "v41-tiny"  # 8 experts top 2: 4 a rank, routing live
# (prompt, tokens to generate, sampling): rank 0 runs sequences 0 and 2, rank 1 sequence 1 (the shorter: it idles)
SEQUENCES = [(list(range(3, 8)), 3, SamplingParams(temperature=0)),
             (list(range(40, 43)), 1, SamplingParams(temperature=0.9, seed=5)),
             (list(range(100, 104)), 2, SamplingParams(temperature=0.7, seed=11))]


def planned(model: DeepseekV41Flash) -> CompiledModel:
    """`model` (all its experts, or one rank's share) planned for sm90 (fp32 products), run on the CPU."""
    graph = run_passes(model.graph())
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,), dot_fp32=True)
    return CompiledModel(model.config, graph, "sm90", PlanRuntime(graph, plan, {}, {}, model.params(), device="cpu"))


def generate(compiled: CompiledModel, chosen: list[int]) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
    """Greedy or seeded tokens of the `chosen` sequences, batched, and every step's logits of each."""
    states = {i: compiled.new_sequence() for i in chosen}
    feeds = {i: SEQUENCES[i][0] for i in chosen}
    out: dict[int, tuple[list[int], list[torch.Tensor]]] = {i: ([], []) for i in chosen}
    while feeds:
        batch = list(feeds)
        logits = compiled.step([(states[i], feeds[i]) for i in batch], batch_invariant=True)
        for row, i in enumerate(batch):
            prompt, count, params = SEQUENCES[i]
            tokens, rows = out[i]
            rows.append(logits[row].clone())
            tokens.append(sample(logits[row], params, params.seed or 0, len(prompt) + len(tokens)))
            feeds[i] = [tokens[-1]]
            if len(tokens) == count:
                del feeds[i]
    return out


def _rank(rank: int, world: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        model = DeepseekV41Flash.from_pretrained(fixture_dir(FIXTURE), ExpertShard(rank, world))
        compiled = planned(model)
        compiled.runtime = LockstepRuntime(compiled.runtime)
        mine = generate(compiled, list(range(rank, len(SEQUENCES), world)))
        compiled.runtime.finish()
        executor = compiled.runtime.inner.executors()[0]
        mine = {i: (tokens, [row.numpy() for row in rows]) for i, (tokens, rows) in mine.items()}  # no shared memory
        results.put((rank, mine, compiled.runtime.num_idle, executor.uncaptured, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        results.put((rank, None, 0, None, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_give_one_process_s_logits_and_tokens() -> None:
    port = ranks.free_port()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    want = generate(planned(DeepseekV41Flash.from_pretrained(fixture_dir(FIXTURE))), list(range(len(SEQUENCES))))
    got = sorted((results.get(timeout=300) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=30)
    assert [r[4] for r in got] == [None, None], got
    assert got[1][2] > 0 and got[0][3] == EXCHANGED  # rank 1 ran out first and served rank 0's steps
    merged = got[0][1] | got[1][1]
    assert sorted(merged) == [0, 1, 2]
    for i, (tokens, rows) in merged.items():
        assert tokens == want[i][0], i
        assert len(rows) == len(want[i][1])
        assert all(torch.equal(torch.from_numpy(a), b) for a, b in zip(rows, want[i][1], strict=True)), i


def test_moe_nodes_leave_the_segments_only_under_expert_parallelism() -> None:
    model = DeepseekV41Flash.from_pretrained(fixture_dir(FIXTURE))
    graph = run_passes(model.graph())
    plain, split = find_segments(graph), find_segments(graph, uncaptured=EXCHANGED)
    moe = [i for i, n in enumerate(graph.nodes) if n.op == "moe_experts"]
    assert moe and all(any(s.start <= i < s.stop for s in plain) for i in moe)
    assert not any(s.start <= i < s.stop for s in split for i in moe) and len(split) > len(plain)


def test_the_exchange_s_launches_are_built_only_when_asked() -> None:
    model = DeepseekV41Flash.from_pretrained(fixture_dir(FIXTURE))
    graph = run_passes(model.graph())
    plan = make_plan(graph, model.params(), "sm90", buckets=(16, 512))
    attrs = {i: node.attrs for i, node in enumerate(graph.nodes)}
    plain, split = record_launches(plan, attrs), record_launches(plan, attrs, expert_parallel=True)
    assert set(plain) < set(split)
    added = [key for key in split if key not in plain]
    assert added and all(key.startswith(("moe_gemm_kernel", "moe_sum_kernel")) for key in added)
    assert any("TOPK=1," in key for key in added)  # the owner's GEMMs: one pair a row


def test_a_ranks_plan_takes_the_whole_layers_tuned_configs() -> None:
    """A rank's share of the experts (4 of 8 here) is planned with the configs tuned on the whole layer: the cache
    keys `e` = 8, so a plan of the share finds them only through `expert_shards`."""
    from autotune import TuningCache, cache_key, template_hash
    from kernels.registry import LOWERINGS

    model = DeepseekV41Flash.from_pretrained(fixture_dir(FIXTURE), ExpertShard(1, 2))
    graph = run_passes(model.graph())
    tuning, config = TuningCache(None), None
    lowering = LOWERINGS["moe_experts"]
    for node in make_plan(graph, model.params(), "sm90", buckets=(16,), tuning=tuning).kernel_nodes():
        if node.op == "moe_experts":
            assert node.static.e == 4 and node.buckets[16].source == "heuristic"
            config = dict(node.buckets[16].config, marker=7)  # a config no heuristic gives
            whole = lowering.key(lowering.whole(node.static, 2), node.variant)
            assert whole["e"] == 8
            tuning.put(cache_key("moe_experts", whole, 16, "sm90", "NVIDIA H200", template_hash("moe_experts")),
                       config)
    assert config is not None
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,), tuning=tuning, expert_shards=2)
    moe = [n for n in plan.kernel_nodes() if n.op == "moe_experts"]
    assert moe and all(n.buckets[16].source == "tuned" and n.buckets[16].config["marker"] == 7 for n in moe)
    alone = make_plan(graph, model.params(), "sm90", buckets=(16,), tuning=tuning)
    assert all(n.buckets[16].source == "heuristic" for n in alone.kernel_nodes() if n.op == "moe_experts")


@pytest.fixture
def rank_of_one():
    """This process as the one rank of a gloo group."""
    ranks.join_alone("cpu")
    yield
    ranks.leave()


def test_a_failing_forward_ends_the_job_naming_the_rank(rank_of_one) -> None:
    compiled = planned(DeepseekV41Flash.from_pretrained(fixture_dir(FIXTURE)))
    compiled.runtime = LockstepRuntime(compiled.runtime)
    executor = compiled.runtime.inner.executors()[0]
    with pytest.raises(RuntimeError, match="split_experts comes before the first step"):
        compiled.runtime.inner.split_experts(executor.parallel_experts)
    key = next(k for k in executor.formatted if k[0] == "layers.0.ffn.experts.w1.weight")
    executor.formatted[key] = torch.zeros(1, 1, 1, dtype=executor.formatted[key].dtype)  # no forward runs on it
    with pytest.raises(FatalRuntimeError, match="rank 0: a forward failed: ValueError: expert shapes do not chain"):
        compiled.step([(compiled.new_sequence(), [3, 4, 5])], batch_invariant=True)
