"""Plans and ahead-of-time launches as the golden file records them (tests/golden/plans.json, made from the tree before
the kernel families' layout; its "about" says how): for the full-width slice (sm90 with the committed H200 tuning,
and sm100) and the small trained model with its DSpark draft graph, each with and without fp32 products and fp8
activations, every kernel node's template, tuning-key static, backend, weight formats, per bucket the GEMMs that run,
the config and whether it was tuned, its batch-invariant config; and the set of `Launch.key()`s the ahead-of-time
builder records. A difference means a compile builds other kernels, or runs them with other configs, than before."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deepinfer.default_model import trained_model
from deepinfer.models import DeepseekV41Flash
from dsl.passes import run_passes
from graphs.aot import record_launches
from graphs.passes import make_plan
from kernels.registry import LOWERINGS
from kernels.tilelang_build import available as tilelang_builds

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = json.loads((ROOT / "tests" / "golden" / "plans.json").read_text())
sys.path.insert(0, str(ROOT / "bench"))

import bench_slice  # noqa: E402


def view(plan) -> dict[int, list]:
    """Kernel node index -> its view (an entry of the golden's "views"), through JSON as the golden was."""
    out = {}
    for n in plan.kernel_nodes():
        buckets = {str(b): [list(p.gemms), p.config, p.source] for b, p in n.buckets.items()}
        record = [n.op, n.template, LOWERINGS[n.op].key(n.static, n.variant), n.variant.backend,
                  {str(k): v for k, v in n.formats.items()}, buckets, [list(n.invariant.gemms), n.invariant.config]]
        out[n.index] = json.loads(json.dumps(record))
    return out


@pytest.fixture(scope="module")
def models() -> dict:
    config = bench_slice.slice_config()
    full = DeepseekV41Flash(config, bench_slice.slice_weights(config, "meta"))
    small = trained_model()
    return {"slice": (run_passes(full.graph()), full.params()),
            "small": (run_passes(small.graph(dspark=True)), small.params()),
            "draft": (run_passes(small.draft_graph()), small.params())}


@pytest.mark.skipif(not tilelang_builds(), reason="the golden plans were made where TileLang kernels build")
@pytest.mark.parametrize("case", sorted(GOLDEN["cases"]))
def test_the_plan_and_its_launches_are_the_goldens(case, models) -> None:
    name, target, dot_fp32, fp8 = case.split()
    graph, params = models[name]
    plan = make_plan(graph, params, target, dot_fp32=dot_fp32 == "dot_fp32=True",
                     fp8_activations=fp8 == "fp8_activations=True")
    want = GOLDEN["cases"][case]
    views = view(plan)
    assert sorted(views) == [index for index, _ in want["nodes"]]
    for index, view_id in want["nodes"]:
        assert views[index] == GOLDEN["views"][view_id], f"node {index} ({graph.nodes[index].op})"
    launches = record_launches(plan, {i: node.attrs for i, node in enumerate(graph.nodes)})
    assert sorted(launches) == sorted(GOLDEN["launches"][i] for i in want["launches"])
