"""The engine's core stands on its own: it imports nothing of DSpark, runs without it, probes nothing, and calls the
token constraint through a complete Protocol that structured outputs implement."""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.engine.speculator import Speculator
from deepinfer.engine.token_constraint import TokenConstraint

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "deepinfer" / "engine"
CORE = sorted(p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__")  # every file of the engine's folder
DSPARK = ("deepinfer.engine.spec_decode", "deepinfer.dspark")


def source_of(module: str) -> Path | None:
    """The file of a deepinfer module or package (its __init__.py), None for a name that is neither (a class)."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def deepinfer_imports(module: str) -> set[str]:
    """The deepinfer modules and packages `module` (dotted) imports anywhere in its source."""
    found = set()
    for node in ast.walk(ast.parse(source_of(module).read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found |= {n for n in names if n.split(".")[0] == "deepinfer" and source_of(n) is not None}
    return found


def closure(modules: list[str]) -> set[str]:
    """Every deepinfer module and package the `modules` reach through their imports (a package's parents aside:
    importing deepinfer.engine.sampler also runs deepinfer/__init__.py, which the LLM API's imports follow)."""
    seen, todo = set(), list(modules)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += deepinfer_imports(module)
    return seen


def test_the_core_reaches_no_dspark_module() -> None:
    assert {"scheduler", "model_runner", "llm_engine", "sampler"} <= set(CORE)
    reached = closure([f"deepinfer.engine.{name}" for name in CORE])
    assert "deepinfer.sampler" in reached and "dsl.context" not in reached  # the walk follows deepinfer's imports
    assert sorted(m for m in reached if m.startswith(DSPARK)) == []


def test_the_walk_finds_dspark_where_it_is_imported() -> None:
    assert "deepinfer.dspark" in closure(["deepinfer.engine.spec_decode.dspark_speculator"])
    assert "deepinfer.engine.spec_decode" in closure(["deepinfer.llm"])  # a package, through its __init__.py


def test_the_engine_probes_nothing() -> None:
    """No hasattr, and getattr only on the object's own fields (EngineArgs' checks): the compiled model, the token
    constraint and the speculator are used through their attributes."""
    probes = []
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                    "hasattr"):
                own = isinstance(node.args[0], ast.Name) and node.args[0].id == "self"
                if node.func.id == "hasattr" or not own:
                    probes.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert probes == []


def protocol_methods(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(fn) for name, fn in vars(protocol).items()
            if callable(fn) and not name.startswith("_")}


def test_the_protocols_list_what_the_engine_calls() -> None:
    assert set(protocol_methods(TokenConstraint)) == {"submit", "is_ready", "wait_ready", "constrains", "fill",
                                                      "accept", "fill_next", "finish"}
    assert set(protocol_methods(Speculator)) == {"plan", "verify", "propose", "forget"}


@pytest.mark.parametrize(("protocol", "module", "name"), [
    (TokenConstraint, "deepinfer.structured_outputs.constraint", "StructuredOutputConstraint"),
    (Speculator, "deepinfer.engine.spec_decode.dspark_speculator", "DSparkSpeculator"),
])
def test_the_implementations_take_every_protocol_call(protocol: type, module: str, name: str) -> None:
    """Each method of the Protocol exists on the implementation and accepts the Protocol's arguments by position."""
    cls = getattr(__import__(module, fromlist=[name]), name)
    for method, signature in protocol_methods(protocol).items():
        own = inspect.signature(getattr(cls, method))
        wanted = [p for p in signature.parameters.values() if p.name != "self"]
        params = [p for p in own.parameters.values() if p.name != "self"]
        assert len(params) >= len(wanted), (method, own)
        assert all(p.default is not inspect.Parameter.empty for p in params[len(wanted):]), (method, own)


RUN_WITHOUT_DSPARK = """
import sys
import deepinfer
from deepinfer.default_model import default_model
from deepinfer.engine import EngineArgs, LLMEngine
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import load_tokenizer

for name in [m for m in sys.modules if m.startswith({dspark!r})]:
    del sys.modules[name]
for name in {dspark!r}:
    parent, _, child = name.rpartition(".")
    if hasattr(sys.modules[parent], child):
        delattr(sys.modules[parent], child)
    sys.modules[name] = None  # importing it now raises ImportError
compiled = deepinfer.compile(default_model(), "cpu")
engine = LLMEngine(compiled, load_tokenizer(), EngineArgs(max_model_len=64, max_num_seqs=2), (1,))
for prompt in ([5, 6, 7], [9, 10]):
    engine.add_request({{"prompt_token_ids": prompt}}, SamplingParams(max_tokens=4, temperature=0.8, seed=2,
                                                                      ignore_eos=True))
outs = sorted(engine.run(), key=lambda o: int(o.request_id))
print([o.outputs[0].token_ids for o in outs])
"""


def test_the_core_runs_with_dspark_unimportable() -> None:
    """An engine with no speculator schedules, runs and samples with every DSpark module made unimportable, and
    samples what `LLM` does."""
    from deepinfer import LLM
    from deepinfer.default_model import default_model
    from deepinfer.sampling_params import SamplingParams

    run = subprocess.run([sys.executable, "-c", RUN_WITHOUT_DSPARK.format(dspark=DSPARK)], capture_output=True,
                         check=False, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    llm = LLM(default_model(), max_model_len=64, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=2, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": [5, 6, 7]},
                                                          {"prompt_token_ids": [9, 10]}], params, use_tqdm=False)]
    assert run.stdout.strip().splitlines()[-1] == str(want)
