"""Reading an artifact back (graphs/artifact.py, `deepinfer.load`): every file it reads resolves strictly inside the
artifact directory, and a malformed file gives an error naming the file and what is wrong with it. The artifact is an
sm90 build of the tiny fixture, made here without a GPU (once for the module; each test edits a copy)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer.models import DeepseekV41Flash
from graphs import artifact
from graphs.artifact import ArtifactError
from graphs.compiled_model import CompiledModel, RunnableModel
from graphs.plan_runtime import PlanRuntime
from tests.conftest import fixture_dir
from tests.test_gpu_targets import BUILD, run_python

FIXTURE = "v41-tiny"


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("artifact")
    run_python(BUILD.format(fixture=str(fixture_dir(FIXTURE)), target="sm90", out=str(root / "sm90")),
               CUDA_VISIBLE_DEVICES="", DEEPINFER_CACHE=str(root / "cache"))
    return root / "sm90"


@pytest.fixture
def saved(built: Path, tmp_path: Path) -> Path:
    """A copy of the built artifact to edit."""
    return Path(shutil.copytree(built, tmp_path / "artifact"))


@pytest.fixture(scope="module")
def model() -> DeepseekV41Flash:
    return DeepseekV41Flash.from_pretrained(fixture_dir(FIXTURE))


def edit_json(path: Path, change: Callable[[dict], object]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def first_kernel(root: Path) -> tuple[str, str]:
    """(launch key, file id) of plan.json's first kernel entry."""
    return next(iter(json.loads((root / "plan.json").read_text())["kernels"].items()))


def test_a_saved_artifact_loads_as_the_one_compiled_model_type(saved: Path, model) -> None:
    loaded = deepinfer.load(saved, model)
    assert isinstance(loaded, CompiledModel) and isinstance(loaded, RunnableModel)
    assert isinstance(loaded.runtime, PlanRuntime) and loaded.device == torch.device("cuda")
    read = artifact.read(saved)
    assert loaded.runtime.plan.to_json() == read.plan.to_json() and loaded.target == read.manifest["target"]
    assert set(loaded.runtime.specs) == set(json.loads((saved / "plan.json").read_text())["kernels"])
    assert all(cubin.startswith(b"\x7fELF") for cubin in loaded.runtime.cubins.values())
    with pytest.raises(ValueError, match="only a freshly compiled model can be saved"):
        loaded.save(saved.parent / "again")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device"):
            loaded.step([(loaded.new_sequence(), [1, 2, 3])])


def _set(key: str, value) -> Callable[[dict], None]:
    return lambda d: d.__setitem__(key, value)


def _first_node(key: str, value=None) -> Callable[[dict], None]:
    """Drop `key` of the first kernel node (value None), or set it."""
    def change(d: dict) -> None:
        node = next(n for n in d["nodes"] if n["template"])
        node.pop(key) if value is None else node.__setitem__(key, value)
    return change


# (file, how it is edited, what the error says after the file's path)
MALFORMED = [
    ("manifest.json", "{", r"manifest.json: not valid JSON \(Expecting property name"),
    ("manifest.json", b"\xff\xfe{}", r"manifest.json: not UTF-8 text"),
    ("manifest.json", "[1, 2]", r"manifest.json: a JSON object expected, found list"),
    ("manifest.json", lambda d: d.pop("target"), r"manifest.json: no 'target'"),
    ("manifest.json", _set("drafting", "yes"), r"manifest.json: 'drafting' is 'yes', not bool"),
    ("manifest.json", _set("format", True), r"manifest.json: 'format' is True, not int"),
    ("manifest.json", _set("format", 1), r"manifest.json: artifact format 1, this build reads format 2"),
    ("manifest.json", _set("target", "cpu"), r"manifest.json: target 'cpu' is none whose models this build saves"),
    ("manifest.json", _set("drafting", True), r"draft_plan.json: missing"),
    ("plan.json", "", r"plan.json: not valid JSON"),
    ("plan.json", _set("kernels", []), r"plan.json: 'kernels' is \[\], not dict"),
    ("plan.json", lambda d: d.pop("nodes"), r"plan.json: no 'nodes'"),
    ("plan.json", _first_node("op"), r"plan.json: a node has no 'op'"),
    ("plan.json", _first_node("buckets", 7), r"plan.json: not a plan \(AttributeError"),
    ("plan.json", _first_node("invariant"), r"plan.json: a node has no 'invariant'"),
    ("plan.json", _set("target", "sm100"), r"plan.json: planned for sm100, but manifest.json says sm90"),
]


@pytest.mark.parametrize("name,change,message", MALFORMED, ids=[f"{m[0]}-{i}" for i, m in enumerate(MALFORMED)])
def test_a_malformed_file_is_named_with_what_is_wrong(saved: Path, name: str, change, message: str) -> None:
    path = saved / name
    if isinstance(change, bytes):
        path.write_bytes(change)
    elif isinstance(change, str):
        path.write_text(change)
    else:
        edit_json(path, change)
    with pytest.raises(ArtifactError, match=f"^{re.escape(str(saved.resolve()))}/{message}"):
        artifact.read(saved)


def test_a_malformed_kernel_file_is_named(saved: Path) -> None:
    _, file_id = first_kernel(saved)
    spec = saved / "kernels" / f"{file_id}.json"
    kept = spec.read_text()
    for change, message in ((lambda d: d.pop("name"), "no 'name'"), (_set("shared", "0"), "'shared' is '0', not int"),
                            (_set("key", "other"), "the launch spec of 'other', but plan.json lists it for"),
                            (_set("signature", [1]), "'signature' holds \\[1\\], not argument type names"),
                            (_set("backend", "cuda"), "backend 'cuda', not one of triton, tilelang")):
        spec.write_text(kept)
        edit_json(spec, change)
        with pytest.raises(ArtifactError, match=f"kernels/{file_id}.json: {message}"):
            artifact.read(saved)
    spec.write_text(kept)
    cubin = saved / "kernels" / f"{file_id}.cubin"
    cubin.write_bytes(b"not a cubin")
    with pytest.raises(ArtifactError, match=f"kernels/{file_id}.cubin: not a cubin"):
        artifact.read(saved)
    cubin.unlink()
    with pytest.raises(ArtifactError, match=f"kernels/{file_id}.cubin \\(kernel entry '.*' of plan.json\\): missing"):
        artifact.read(saved)


def test_a_plan_for_another_graph_is_refused_at_load(saved: Path, model) -> None:
    edit_json(saved / "plan.json", lambda d: d["nodes"].pop())
    with pytest.raises(ArtifactError, match=r"plan.json: the plan does not match the model's graph"):
        deepinfer.load(saved, model)


def test_an_artifact_lacking_a_kernel_this_build_runs_is_refused_at_load(saved: Path, model) -> None:
    """As one saved by an older DeepInfer, before a kernel it would now launch existed: refused at load, naming the
    launch, not mid-step."""
    key, _ = first_kernel(saved)
    edit_json(saved / "plan.json", lambda d: d["kernels"].pop(key))
    with pytest.raises(ArtifactError, match=re.escape(f"plan.json: holds no kernel for 1 launch(es) this build of "
                                                      f"DeepInfer makes, {key}: it was saved by another version")):
        deepinfer.load(saved, model)


@pytest.mark.parametrize("entry", ["../../elsewhere/x", "/tmp/x", "..", "", "a\\b"])
def test_a_kernel_entry_naming_a_path_is_refused(saved: Path, entry: str) -> None:
    key, file_id = first_kernel(saved)
    outside = saved.parent / "elsewhere"
    outside.mkdir()
    for ext in ("json", "cubin"):  # a kernel that would load, were the entry followed
        shutil.copy(saved / "kernels" / f"{file_id}.{ext}", outside / f"x.{ext}")
    edit_json(saved / "plan.json", lambda d: d["kernels"].__setitem__(key, entry))
    named = f"kernel entry '.*' of plan.json names {re.escape(repr(entry))}"
    with pytest.raises(ArtifactError, match=f"{named}, not a file name in kernels/"):
        artifact.read(saved)


@pytest.mark.parametrize("linked", ["manifest.json", "plan.json", "kernels/{id}.json", "kernels/{id}.cubin", "kernels"])
def test_a_symlink_leaving_the_directory_is_refused(saved: Path, linked: str) -> None:
    _, file_id = first_kernel(saved)
    path = saved / linked.format(id=file_id)
    outside = saved.parent / ("moved" + path.suffix)
    shutil.move(path, outside)  # the same file (or folder), outside
    path.symlink_to(outside, target_is_directory=outside.is_dir())
    with pytest.raises(ArtifactError, match="leaves the artifact directory"):
        artifact.read(saved)


def test_a_symlink_staying_inside_is_followed(saved: Path) -> None:
    _, file_id = first_kernel(saved)
    cubin = saved / "kernels" / f"{file_id}.cubin"
    shutil.move(cubin, saved / "kept.cubin")
    cubin.symlink_to(Path("..") / "kept.cubin")
    assert artifact.read(saved).cubins[first_kernel(saved)[0]] == (saved / "kept.cubin").read_bytes()


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="no artifact directory there"):
        artifact.read(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArtifactError, match=r"manifest\.json: missing"):
        deepinfer.load(tmp_path / "empty")
