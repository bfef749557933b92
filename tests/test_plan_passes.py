"""The plan's passes (graphs/passes/) and the registry they read (kernels/registry.py): the passes run in order and
`DEEPINFER_DEBUG=ir` shows the plan after each; the backend is the target's rule among the template's own, skipping
one that cannot build here (said once); the registry holds every family's lowerings and nothing else."""

from __future__ import annotations

import json
import logging
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kernels
from deepinfer.models import DeepseekV41Flash
from dsl.ops import OPS
from dsl.passes import run_passes
from graphs.passes import make_plan
from graphs.passes.select_kernels import backend_for
from kernels import registry
from kernels.lowering import TILELANG, TRITON
from kernels.targets import TARGETS, Target
from tests.conftest import fixture_dir


@pytest.fixture(scope="module")
def smooth():
    model = DeepseekV41Flash.from_pretrained(fixture_dir("v41-smooth"))
    return run_passes(model.graph()), model.params()


@pytest.mark.parametrize("fp8", [False, True])
def test_debug_ir_prints_the_plan_after_each_pass(smooth, fp8, monkeypatch, capsys) -> None:
    graph, params = smooth
    monkeypatch.setenv("DEEPINFER_DEBUG", "ir")
    plan = make_plan(graph, params, "sm90", buckets=(16,), fp8_activations=fp8)
    err = capsys.readouterr().err
    passes = ["select_kernels"] + ["fp8_activations"] * fp8 + ["choose_configs"]
    assert [line.removeprefix("// after ") for line in err.splitlines() if line.startswith("// after ")] == passes
    after_select = err.split("// after ")[1]
    assert "rms_norm: rms_norm" in after_select and "[]" in after_select  # chosen, no configs yet
    assert str(plan) in err  # the last pass's output is the plan


def test_no_kernels_for_a_target_without_backends(smooth) -> None:
    graph, params = smooth
    with pytest.raises(ValueError, match="target 'cpu' builds no kernels"):
        make_plan(graph, params, "cpu")


def test_the_backend_is_the_targets_rule_and_one_that_cannot_build_is_said_once(monkeypatch, caplog) -> None:
    collapse = registry.LOWERINGS["hc_collapse_rms_norm"]
    linear = registry.LOWERINGS["linear"]
    monkeypatch.setitem(TARGETS, "triton-only", Target("triton-only", "test", "plan", (TRITON,), (9, 0)))
    monkeypatch.setitem(TARGETS, "tilelang-only", Target("tilelang-only", "test", "plan", (TILELANG,), (9, 0)))
    assert backend_for(collapse, "triton-only") == TRITON
    assert backend_for(linear, "tilelang-only") is None  # a Triton-only template there: its reference runs
    monkeypatch.setenv("DEEPINFER_TILELANG", "0")
    monkeypatch.setattr(registry, "_said", set())
    with caplog.at_level(logging.WARNING, logger="kernels.registry"):
        assert backend_for(collapse, "sm90") == TRITON and backend_for(collapse, "sm100") == TRITON
    assert [r.getMessage().startswith("TileLang kernels cannot be built here") for r in caplog.records] == [True]


def test_the_registry_finds_every_family_from_outside_the_repository(tmp_path) -> None:
    """Run from another folder, where `import kernels` may give another distribution's top-level package (Hugging
    Face's, which transformers requires) while `kernels.<family>` still imports from here: the same families and
    lowerings as in this process."""
    code = ("import json; from kernels import registry; "
            "print(json.dumps([registry.families(), sorted(registry.LOWERINGS)]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert json.loads(out) == [registry.families(), sorted(registry.LOWERINGS)]


def test_the_registry_holds_every_family_and_only_known_ops() -> None:
    folders = sorted(p.parent.name for p in Path(kernels.__file__).parent.glob("*/lowering.py"))
    assert registry.families() == folders and len(folders) >= 10
    assert {m.name for m in pkgutil.iter_modules(kernels.__path__) if m.ispkg} >= set(folders) | {"cache", "sampling"}
    assert set(registry.LOWERINGS) <= set(OPS)
    for op, lowering in registry.LOWERINGS.items():
        assert op in lowering.ops and registry.TEMPLATES[lowering.template].sources == lowering.sources
        assert lowering.sources and set(lowering.backends) <= {TRITON, TILELANG}
    assert set(registry.tunable()) <= set(registry.TUNINGS) <= set(registry.TEMPLATES)
    assert all(registry.TUNINGS[t].job and registry.TUNINGS[t].shapes for t in registry.tunable())
