"""The sm90 / sm100 targets: the artifact contract on a machine with no GPU, the plan's executor against the cpu
target under Triton's interpreter, and (on a GPU) a saved sm90 artifact run with torch and the CUDA driver alone."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsl.context import SequenceState
from tests.conftest import fixture_dir, oracle, rel_l2

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, **env: str) -> str:
    """Run `code` in a fresh interpreter at the repo root, Triton compiling for real (no TRITON_INTERPRET)."""
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def cubin_arch(cubin: bytes) -> int:
    """The SM version an ELF cubin was built for (e_flags: low byte in the old ABI, next byte in the new)."""
    assert cubin[:4] == b"\x7fELF"
    flags = struct.unpack_from("<I", cubin, 0x30)[0]
    return flags & 0xFF if cubin[7] == 0x33 else (flags >> 8) & 0xFF


BUILD = """
import deepinfer
from deepinfer.models import DeepseekV41Flash
model = DeepseekV41Flash.from_pretrained({fixture!r})
deepinfer.compile(model, target={target!r}, buckets=(16,)).save({out!r})
"""


@pytest.mark.parametrize("target,arch", [("sm90", 90), ("sm100", 100)])
def test_compile_saves_an_artifact_without_a_gpu(target, arch, tmp_path) -> None:
    out = tmp_path / target
    run_python(BUILD.format(fixture=str(fixture_dir("v41-smooth")), target=target, out=str(out)),
               CUDA_VISIBLE_DEVICES="", DEEPINFER_CACHE=str(tmp_path / "cache"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["target"] == target and manifest["arch"] == f"sm_{arch}a"
    plan = json.loads((out / "plan.json").read_text())
    cubins = sorted((out / "kernels").glob("*.cubin"))
    assert len(cubins) == manifest["num_cubins"] == len(plan["kernels"]) > 0
    assert manifest["num_kernel_nodes"] == sum(1 for n in plan["nodes"] if n["template"])
    for key, file_id in plan["kernels"].items():
        spec = json.loads((out / "kernels" / f"{file_id}.json").read_text())
        assert spec["key"] == key and spec["target"] == target
        assert spec["pdl"], f"{key}: its code does not wait for the grids before it first (kernels.lang.pdl_prologue)"
        assert cubin_arch((out / "kernels" / f"{file_id}.cubin").read_bytes()) == arch
        assert f".target sm_{arch}a" in (out / "kernels" / f"{file_id}.ptx").read_text()
    assert {k.split("(")[0] for k in plan["kernels"]} >= {"gumbel_argmax_kernel", "argmax_partials_kernel"}  # sampling
    templates = {n["template"] for n in plan["nodes"] if n["template"]}
    assert templates == {"linear", "rms_norm", "hc_mixes", "hc_collapse_rms_norm", "hc_update_mixes", "hc_add_expand",
                         "rope", "rope_round", "moe_experts", "swiglu", "moe_gate", "sparse_attention",
                         "index_scores", "compress_pool", "topk_select", "candidate_blocks"}
    kernel_nodes = [n for n in plan["nodes"] if n["template"]]
    assert all(n["invariant"]["config"] is not None for n in kernel_nodes)
    assert all(n["invariant"]["config"]["split_kv"] == 1 for n in kernel_nodes if n["template"] == "sparse_attention")


def test_sm100_builds_the_checkpoints_fp8_and_fp4_kernels_without_a_gpu(tmp_path) -> None:
    """The checkpoint's storage formats for Blackwell: fp8 32x32-block linears and the fp4 experts, whose codes go
    through inline PTX (built, not run: there is no sm_100 GPU here)."""
    from deepinfer.config import DeepseekV41Config
    from tests.test_checkpoint import _quantize, _tensors, _write

    config = DeepseekV41Config.from_pretrained(fixture_dir("v41-smooth"))
    checkpoint = _write(tmp_path / "checkpoint", _quantize(_tensors("v41-smooth"), config), fixture_dir("v41-smooth"))
    out = tmp_path / "sm100"
    run_python(BUILD.format(fixture=str(checkpoint), target="sm100", out=str(out)), CUDA_VISIBLE_DEVICES="",
               DEEPINFER_CACHE=str(tmp_path / "cache"))
    plan = json.loads((out / "plan.json").read_text())
    experts = [n for n in plan["nodes"] if n["template"] == "moe_experts"]
    assert experts and all(n["static"]["fmt"] == "fp4" and n["formats"]["6"] == "prescaled" for n in experts)
    assert "fp8" in {n["static"].get("fmt") for n in plan["nodes"] if n["template"] == "linear"}
    specs = [json.loads(f.read_text()) for f in (out / "kernels").glob("*.json")]
    assert any(s["name"].startswith("moe_gemm_kernel") and s["constexprs"]["FP4"] and s["constexprs"]["ASM"]
               for s in specs)
    for f in (out / "kernels").glob("*.cubin"):
        assert cubin_arch(f.read_bytes()) == 100, f.name


def test_sm90_builds_the_fp8_activation_kernels_without_a_gpu(tmp_path) -> None:
    """fp8 activations on the checkpoint's formats: the norms that write e4m3 rows for their linears, the GEMM reading
    those rows (their codes a row stride apart), and the shared expert's SwiGLU kernel, all built."""
    from deepinfer.config import DeepseekV41Config
    from tests.test_checkpoint import _quantize, _tensors, _write

    config = DeepseekV41Config.from_pretrained(fixture_dir("v41-smooth"))
    checkpoint = _write(tmp_path / "checkpoint", _quantize(_tensors("v41-smooth"), config), fixture_dir("v41-smooth"))
    out = tmp_path / "sm90"
    run_python(BUILD.format(fixture=str(checkpoint), target="sm90", out=str(out)).replace(
        "buckets=(16,)", "buckets=(16,), fp8_activations=True"), CUDA_VISIBLE_DEVICES="",
        DEEPINFER_CACHE=str(tmp_path / "cache"))
    plan = json.loads((out / "plan.json").read_text())
    writers = {n["op"] for n in plan["nodes"] if n["template"] and n["variant"]["e4m3_out"]}
    assert writers == {"rms_norm", "hc_collapse_rms_norm"}
    assert any(n["variant"]["e4m3_in"] for n in plan["nodes"] if n["template"] == "linear")
    specs = [json.loads(f.read_text()) for f in (out / "kernels").glob("*.json")]
    names = {s["name"] for s in specs}
    assert {"rms_norm_e4m3_kernel", "hc_collapse_rms_norm_e4m3_kernel", "swiglu_kernel"} <= names, names
    rowwise = [s["constexprs"] for s in specs if s["name"] == "linear_rowwise_kernel"]
    assert any(c["stride_A"] > c["K"] for c in rowwise) and any(c["stride_A"] == c["K"] for c in rowwise)
    for f in (out / "kernels").glob("*.cubin"):
        assert cubin_arch(f.read_bytes()) == 90, f.name


CACHE_WITHOUT_PTX = """
import json, sys, torch
from pathlib import Path
import graphs.aot as aot
from graphs.artifact import save
from graphs.passes import make_plan
from deepinfer.models import DeepseekV41Flash
from kernels.launch import use_launcher
from kernels.engram.gate import engram_gate
meta = lambda *s: torch.empty(*s, device="meta")
found = {}
with use_launcher(lambda call: found.setdefault(call.key(), call)):
    engram_gate(meta(4, 4, 64), meta(4, 320), meta(4, 64), meta(4, 64), eps=1e-20)
first = aot.build(found, "sm90")
cache = Path(sys.argv[1]) / "cubins"
for ptx in cache.glob("*.ptx"):
    ptx.unlink()
aot.compile_launch = lambda *a: sys.exit("compiled again: the cache was not used")
again = aot.build(found, "sm90")
key = next(iter(found))
assert again[key].cubin == first[key].cubin and first[key].ptx and again[key].ptx == ""
model = DeepseekV41Flash.from_pretrained("tests/fixtures/v41-smooth")
save(Path(sys.argv[1]) / "artifact", make_plan(model.graph(), model.params(), "sm90"), again, {}, None)
print(json.dumps(sorted(p.suffix for p in (Path(sys.argv[1]) / "artifact" / "kernels").iterdir())))
"""


def test_a_cache_without_ptx_still_serves_its_cubins(tmp_path) -> None:
    """bench/prepare_gpu.py drops the PTX from what a device call carries: the cubins are still found, and an
    artifact saved from them simply has no PTX to read."""
    out = run_python(CACHE_WITHOUT_PTX.replace("sys.argv[1]", repr(str(tmp_path))), CUDA_VISIBLE_DEVICES="",
                     DEEPINFER_CACHE=str(tmp_path))
    assert json.loads(out.splitlines()[-1]) == [".cubin", ".json"]


@pytest.mark.parametrize("fixture", ["v41-smooth", "v41-smooth-engram"])
def test_executor_matches_the_cpu_target_under_the_interpreter(fixture, compiled_fixture) -> None:
    """Every kernel node of a smooth fixture on Triton's interpreter (fp32 products) against the cpu target."""
    from deepinfer.models import DeepseekV41Flash
    from dsl.context import ForwardContext
    from dsl.passes import run_passes
    from graphs.executor import Executor
    from graphs.passes import make_plan

    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    model = DeepseekV41Flash.from_pretrained(fixture_dir(fixture))
    graph = run_passes(model.graph())
    ids = torch.tensor(oracle(fixture)["input_ids"][0, :6])
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,), dot_fp32=True)
    executor = Executor(graph, plan, model.params(), "cpu")
    want = compiled_fixture(fixture).forward(ids[None])[0]
    for invariant in (False, True):  # the bucket's configs, then the invariant ones
        ctx = ForwardContext([SequenceState()], [len(ids)])
        got = executor.run({"input_ids": ids}, ctx, invariant)["logits"]
        assert rel_l2(got.numpy(), want.numpy()) < 1e-4
    assert executor.kernel_calls == 2 * len(plan.kernel_nodes()) > 2 * 100
    assert ("engram_gate" in {n.op for n in plan.kernel_nodes()}) == fixture.endswith("engram")
    assert ("engram_hash_rows" in {n.op for n in plan.kernel_nodes()}) == fixture.endswith("engram")
    assert "rope_entries_fp4_round" in {n.op for n in plan.kernel_nodes()}  # the rope kernel on the compressed entries


ENGRAM_LOOKUP = """
import json, sys, torch
import graphs.aot as aot
from deepinfer.config import DeepseekV41Config
from deepinfer.models.engram_layout import engram_layers
from dsl.builder import GraphBuilder
from dsl.passes import run_passes
from dsl.tensor import num_tokens
from graphs.passes import make_plan
c = engram_layers(DeepseekV41Config(engram_layer_ids=(1, 14), engram_num_embeddings=(0, 0)))[14]
rows = c.offsets[-1] + c.primes[-1][-1]
b = GraphBuilder()
ids = b.engram_hash(b.input("ngrams", (num_tokens, 4), "int64"), multipliers=c.multipliers, primes=c.primes,
                    offsets=c.offsets)
table, scale = b.param("table", (rows, 256), "float8_e4m3fn"), b.param("scale", (rows, 8), "float32")
b.output("rows", b.engram_rows(ids, table, scale))
graph = run_passes(b.graph)
params = {"table": torch.empty(rows, 256, dtype=torch.float8_e4m3fn, device="meta"),
          "scale": torch.empty(rows, 8, device="meta")}
plan = make_plan(graph, params, "sm90", buckets=(16, 8192))
found = aot.record_launches(plan, {i: n.attrs for i, n in enumerate(graph.nodes)})
built = {target: aot.build(found, target) for target in ("sm90", "sm100")}
print(json.dumps({"rows": rows, "ops": [n.op for n in graph.nodes], "keys": sorted(found),
                  "specs": {t: [b.spec for b in v.values()] for t, v in built.items()}}))
"""


def test_the_engram_lookup_is_built_ahead_of_time(tmp_path) -> None:
    """Engram's fused hash and gather at V4.1-Flash's sizes (layer 14's constants, an fp8 table of 384M rows with
    its scales, as meta tensors): the fusion, its lowering's launches per bucket, cubins for sm90 and sm100."""
    out = json.loads(run_python(ENGRAM_LOOKUP, CUDA_VISIBLE_DEVICES="", DEEPINFER_CACHE=str(tmp_path)).splitlines()[-1])
    assert out["ops"] == ["engram_hash_rows"] and out["rows"] > 2**28
    assert len(out["keys"]) == 2  # a token a program at 16 tokens, a block of them at 8192
    assert all(k.startswith("engram_hash_rows_kernel(*i64,*fp8e4nv,*fp32,*fp32,i32)") for k in out["keys"])
    for target, arch in (("sm90", 90), ("sm100", 100)):
        assert [s["arch"] for s in out["specs"][target]] == [f"sm_{arch}a"] * 2


RUN_ARTIFACT = """
import sys
sys.modules["triton"] = None  # the artifact runs with torch and the CUDA driver alone
import json, numpy as np, torch, deepinfer
from deepinfer.models import DeepseekV41Flash
from tests.conftest import oracle, rel_l2
o = oracle("v41-smooth")
m = deepinfer.load({path!r}, DeepseekV41Flash.from_pretrained("tests/fixtures/v41-smooth"))
logits = m.forward(torch.tensor(o["full_ids"])).cpu().numpy()
ref = o["full_logits"]
print(json.dumps({{"rel": rel_l2(logits, ref), "argmax": float((logits.argmax(-1) == ref.argmax(-1)).mean()),
                  "launches": m.runtime.launcher.launches, "triton": sys.modules.get("triton") is not None}}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("dot_fp32", [False, True])
def test_saved_sm90_artifact_runs_with_the_driver_alone(dot_fp32, tmp_path) -> None:
    """A prebuilt artifact ($DEEPINFER_ARTIFACTS/smooth-{bf16,fp32}, built on a GPU-less machine) when there is
    one, else one compiled here; run in a process where `import triton` fails."""
    name = "smooth-fp32" if dot_fp32 else "smooth-bf16"
    prebuilt = os.environ.get("DEEPINFER_ARTIFACTS")
    path = Path(prebuilt) / name if prebuilt else tmp_path / name
    if not prebuilt:
        run_python(BUILD.format(fixture=str(fixture_dir("v41-smooth")), target="sm90", out=str(path)).replace(
            "target='sm90'", f"target='sm90', dot_fp32={dot_fp32}"))
    result = json.loads(run_python(RUN_ARTIFACT.format(path=str(path))).strip().splitlines()[-1])
    assert not result["triton"] and result["launches"] > 0
    if dot_fp32:
        assert result["rel"] < 1e-4 and result["argmax"] == 1.0
    else:  # the scale of a bf16 run of the reference (fixtures README): ~1.5e-2, 96-98% argmax agreement
        assert result["rel"] < 2.5e-2 and result["argmax"] >= 0.95
    if os.environ.get("DEEPINFER_RESULTS_DIR"):  # bench/run_gpu.sh collects these for bench/RESULTS.md
        Path(os.environ["DEEPINFER_RESULTS_DIR"], f"e2e_{name}.json").write_text(json.dumps(result))


def test_cubin_arch_reads_both_elf_abis() -> None:
    old = bytearray(64)
    old[:4], old[7] = b"\x7fELF", 0x33
    struct.pack_into("<I", old, 0x30, 0x5A0D5A)
    new = bytearray(64)
    new[:4], new[7] = b"\x7fELF", 0x41
    struct.pack_into("<I", new, 0x30, 0x900640A)
    assert (cubin_arch(bytes(old)), cubin_arch(bytes(new))) == (90, 100)


# ---- batch-invariant configs --------------------------------------------------------------------------------------

def planned(model_name: str):
    """(graph, plan) of the smooth fixture (heuristic configs), or of a 4-layer V4.1-Flash of the real sizes and
    checkpoint formats (meta weights), whose configs come from the committed H200 tuning."""
    from deepinfer.config import DeepseekV41Config
    from deepinfer.models import DeepseekV41Flash
    from dsl.passes import run_passes
    from graphs.passes import make_plan
    from tests.test_autotune import meta_checkpoint_model

    if model_name == "smooth":
        model = DeepseekV41Flash.from_pretrained(fixture_dir("v41-smooth"))
    else:
        model = meta_checkpoint_model(DeepseekV41Config(num_hidden_layers=4))
    graph = run_passes(model.graph())
    return graph, make_plan(graph, model.params(), "sm90")


def launch_keys(graph, node, chosen, m: int) -> frozenset[str]:
    """The kernel variants (kernel, constexprs: tiles, split counts and K ranges) a node launches for m tokens with
    one bucket's plan (`chosen`: its GEMMs and config)."""
    from kernels.launch import use_launcher
    from kernels.registry import LOWERINGS

    found = set()
    with use_launcher(lambda call: found.add(call.key())):
        LOWERINGS[node.op].trace(node.call(chosen, graph.nodes[node.index].attrs, False, tokens=m))
    return frozenset(found)


def test_a_buckets_trace_adds_one_tokens_launches_only_outside_exact_counts() -> None:
    """Under a decode bucket's config a trace also runs one token where one token launches other kernels (the one-row
    projections, the unrouted experts, the one-launch mixes), so the ahead-of-time builder builds them; inside
    `exact_counts()` it runs the bucket's count alone, what a step of that many tokens launches."""
    from kernels.lowering import exact_counts

    graph, plan = planned("smooth")
    added = set()
    for node in plan.kernel_nodes():
        chosen = node.at(16, plan.buckets)
        traced = launch_keys(graph, node, chosen, 16)
        with exact_counts():
            alone, one = launch_keys(graph, node, chosen, 16), launch_keys(graph, node, chosen, 1)
        assert alone <= traced <= alone | one, node.op
        if traced != alone:
            added.add(node.op)
    assert {"linear", "moe_experts", "moe_gate", "hc_mixes", "hc_expand_mixes"} <= added


@pytest.mark.parametrize("model_name", ["smooth", "v41"])
def test_invariant_configs_launch_the_same_kernels_for_every_token_count(model_name) -> None:
    """Whatever the token count, a node's invariant config launches the same variants (so no tile or split is
    chosen from it), attention in one part; the per-bucket configs do change with the count."""
    from dataclasses import replace

    from graphs.plan import INVARIANT_TOKENS
    from kernels.registry import LOWERINGS

    graph, plan = planned(model_name)
    counts = (1, 5, 64, 300, 4096)
    changing = 0
    for node in plan.kernel_nodes():
        at = node.at(INVARIANT_TOKENS, plan.buckets)
        assert node.invariant == replace(at, config=LOWERINGS[node.op].invariant(at.config))
        assert node.at(7, plan.buckets, batch_invariant=True) is node.invariant
        assert len({launch_keys(graph, node, node.invariant, m) for m in counts}) == 1, node
        changing += len({launch_keys(graph, node, node.at(m, plan.buckets), m) for m in counts}) > 1
        if node.template == "sparse_attention":
            assert node.invariant.config["split_kv"] == 1
    assert changing > 0


def test_the_plan_round_trips_and_one_of_another_format_says_to_recompile() -> None:
    from graphs.plan import Plan

    _, plan = planned("smooth")
    saved = json.loads(json.dumps(plan.to_json()))
    again = Plan.from_json(saved)
    assert [(n.template, n.static, n.variant, n.formats, n.buckets, n.invariant) for n in again.nodes] == [
        (n.template, n.static, n.variant, n.formats, n.buckets, n.invariant) for n in plan.nodes]
    # every kernel node keeps its invariant config (an artifact whose plan lacks one is refused at load:
    # tests/test_artifact.py)
    assert all(n.invariant is not None for n in again.kernel_nodes())
    saved["format"] -= 1  # a plan.json of an earlier layout
    with pytest.raises(ValueError, match="compile the model again"):
        Plan.from_json(saved)


@pytest.mark.parametrize("model_name", ["smooth", "v41"])
def test_batch_invariant_mode_swaps_no_reference_node(model_name) -> None:
    """graphs/plan_runtime.py runs a plan's reference nodes as they are in batch-invariant mode. Of the ops whose
    reference has a batch-invariant version (dsl/ops), a plan leaves only the compressor's
    ratio-1 pooling, which passes its rows through untouched, and the indexer's key projection over the compressed
    entries (which only chooses entries)."""
    from dsl.context import ForwardContext
    from dsl.ops import invariant_references
    from dsl.ops.compressor import compress_pool

    graph, plan = planned(model_name)
    left = [graph.nodes[n.index] for n in plan.nodes if not n.template and n.op in invariant_references()]
    assert {node.op for node in left} == {"compress_pool", "linear"}
    for node in left:
        if node.op == "compress_pool":
            assert node.attrs["ratio"] == 1 and node.inputs[1] is None
        else:
            assert node.inputs[1].name.endswith(".attn.indexer.wk.weight")
    kv = torch.randn(5, 8)
    entries = compress_pool(kv, layer=0, ratio=1, ctx=ForwardContext([SequenceState()], [5]))
    assert entries.values is kv and entries.counts == [5]


def test_recording_a_plans_launches_imports_no_dynamo() -> None:
    """`compile` records every launch on meta tensors before it builds or loads anything; a meta kernel written in
    Python (torch.cat's) imports torch._dynamo on its first call, most of a second of every `LLM()` on a GPU target.
    The recording (the embedded checkpoint's main and draft graphs, and a fixture's) runs none."""
    out = run_python("""
import sys
from deepinfer.compile import _launches
from deepinfer.models import DeepseekV41Flash
from dsl.passes import run_passes
from graphs.passes import make_plan
for name, drafting in (("deepinfer/checkpoints/v41-tiny-stdlib", True), ("tests/fixtures/v41-smooth", False)):
    model = DeepseekV41Flash.from_pretrained(name)
    graphs = [run_passes(model.graph(dspark=drafting))] + ([run_passes(model.draft_graph())] if drafting else [])
    plans = [make_plan(g, model.params(), "sm90") for g in graphs]
    print(len(_launches(graphs, plans, model.config.vocab_size)), "torch._dynamo" in sys.modules)
""", DEEPINFER_TILELANG="0")
    counts = [line.split() for line in out.strip().splitlines()]
    assert len(counts) == 2 and all(int(n) > 50 and imported == "False" for n, imported in counts), out
