"""`compile(..., fp8_activations=True)`: the linears over fp8 32x32-block weights take the e4m3-activation kernel
(kernels/linear/fp8.py) and their weights one scale per row; the plan says so and keeps saying so when saved.
Norms read only by those linears round their rows to e4m3 for them in the same pass. On a checkpoint written in the
real formats, under Triton's interpreter, the executor is what the cpu target gives with those linears emulated in
torch (per-token e4m3 rounding, rowwise weights, fp32 products), and near the exact cpu target: within the error
e4m3's three mantissa bits bring."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer.config import DeepseekV41Config
from deepinfer.models import DeepseekV41Flash
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from dsl.ops.dense import linear as reference_linear
from dsl.passes import run_passes
from graphs.executor import Executor
from graphs.passes import make_plan
from graphs.plan import Plan
from kernels.linear.fp8 import linear_rowwise_ref, quantize_rows_ref, rowwise_weight
from kernels.lowering import TRITON, Variant
from tests.conftest import fixture_dir, oracle, rel_l2
from tests.test_checkpoint import _quantize, _tensors, _write


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> DeepseekV41Flash:
    """The smooth fixture stored in the checkpoint's fp8 / fp4 formats."""
    config = DeepseekV41Config.from_pretrained(fixture_dir("v41-smooth"))
    path = _write(tmp_path_factory.mktemp("fp8"), _quantize(_tensors("v41-smooth"), config), fixture_dir("v41-smooth"))
    return DeepseekV41Flash.from_pretrained(path)


def emulated_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The fp8-activation linear in torch where the plan uses it (fp8 weight, 32x32 scales), else the reference."""
    if w.dtype != torch.float8_e4m3fn or x.dim() != 2:
        return reference_linear(x, w, scale)
    return linear_rowwise_ref(*quantize_rows_ref(x), *rowwise_weight(w, scale))


def fmt(node) -> str | None:
    """A kernel node's weight format (linears, the shared expert, the experts), else None."""
    return node.static.fields().get("fmt") if node.template else None


def test_the_plan_takes_the_fp8_kernel_for_fp8_weights_only(quantized, tmp_path: Path) -> None:
    graph, params = run_passes(quantized.graph()), quantized.params()
    exact = make_plan(graph, params, "sm90", buckets=(16,))
    plan = make_plan(graph, params, "sm90", buckets=(16,), fp8_activations=True)
    changed = 0
    for before, after in zip(exact.nodes, plan.nodes, strict=True):  # fp8 single-group linears change, and norms
        st = before.static  # read only by them (test_norms_read_only_by_fp8_linears_write_e4m3_rows)
        rows = before.template == "linear" and st.fmt == "fp8" and st.groups == 1
        assert after.static == (replace(st, fmt="fp8_rows") if rows else st)
        want = Variant(TRITON, e4m3_out=True) if after.variant.e4m3_out else before.variant  # the fused rounding's
        assert after.variant == replace(want, e4m3_in=after.variant.e4m3_in)
        changed += rows
    assert changed
    rows = [n for n in plan.nodes if fmt(n) == "fp8_rows"]
    assert all(n.formats == {1: "fp8_rows", 2: "fp8_rows_scale"} and n.buckets[16].config["block_K"] == 128
               for n in rows)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.fp8_activations and not Plan.from_json(exact.to_json()).fp8_activations
    assert [(n.static, n.variant, n.buckets) for n in again.nodes] == [(n.static, n.variant, n.buckets)
                                                                        for n in plan.nodes]
    with pytest.raises(ValueError, match="cpu target"):
        deepinfer.compile(quantized, "cpu", fp8_activations=True)


def test_norms_read_only_by_fp8_linears_write_e4m3_rows(quantized) -> None:
    """An RMSNorm (or collapse + RMSNorm) whose every reader is an fp8-activation linear, reading it as its input,
    writes e4m3 rows and those linears read them; every other node is as it was. The attention's wq_a and wkv
    share theirs, the q_norm's wq_b (and the indexer's) theirs; no norm writes them without fp8 activations."""
    graph, params = run_passes(quantized.graph()), quantized.params()
    plan = make_plan(graph, params, "sm90", buckets=(16,), fp8_activations=True)
    readers: dict[int, list[tuple[int, int]]] = {}
    for i, node in enumerate(graph.nodes):
        for pos, v in enumerate(node.inputs):
            if v is not None:
                readers.setdefault(id(v), []).append((i, pos))
    written = {"rms_norm": 0, "hc_collapse_rms_norm": 0}
    for i, node in enumerate(graph.nodes):
        if node.op not in written or not plan.nodes[i].template:
            continue
        reads = readers[id(node.outputs[0])]
        only_fp8 = all(pos == 0 and fmt(plan.nodes[j]) == "fp8_rows" for j, pos in reads)
        assert plan.nodes[i].variant.e4m3_out == only_fp8, (i, node.op)
        assert all(plan.nodes[j].variant.e4m3_in == only_fp8 for j, _ in reads)
        written[node.op] += only_fp8
    assert all(written.values()), written
    assert sum(n.variant.e4m3_in for n in plan.nodes) > sum(written.values())  # readers share rows
    exact = make_plan(graph, params, "sm90", buckets=(16,))
    assert not any(n.variant.e4m3_out or n.variant.e4m3_in for n in exact.nodes)


def test_executor_is_the_emulated_fp8_linears(quantized) -> None:
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs where there is no GPU")
    graph, params = run_passes(quantized.graph()), quantized.params()
    ids = torch.tensor(oracle("v41-smooth")["input_ids"][0, :6])
    plan = make_plan(graph, params, "sm90", buckets=(16,), dot_fp32=True, fp8_activations=True)
    executor = Executor(graph, plan, params, "cpu")
    got = executor.run({"input_ids": ids}, ForwardContext([SequenceState()], [len(ids)]))["logits"]
    cpu = {k: v.float() if v.is_floating_point() and v.dtype != torch.float8_e4m3fn else v for k, v in params.items()}
    want = interpret(graph, {"input_ids": ids}, cpu, ForwardContext([SequenceState()], [len(ids)]),
                     kernels={"linear": emulated_linear})["logits"]
    exact = interpret(graph, {"input_ids": ids}, cpu, ForwardContext([SequenceState()], [len(ids)]))["logits"]
    assert rel_l2(got.numpy(), want.numpy()) < 1e-4
    error = rel_l2(got.numpy(), exact.numpy())
    # rounded activations move the logits, but not far: 8.3e-2 here (6.4e-2 over the 64 tokens of `full_ids`, 95%
    # argmax agreement; a bf16 run of the reference is at 1.5e-2)
    assert 1e-2 < error < 0.12, error


@pytest.mark.gpu
def test_sm90_fp8_activations_end_to_end(quantized) -> None:
    """On the GPU: the fp8-activation model against the exact cpu target of the same checkpoint over `full_ids`, and
    the sm90 model without it, which must be much nearer (the rounding is what moves the logits)."""
    ids = torch.tensor(oracle("v41-smooth")["full_ids"])
    exact = deepinfer.compile(quantized, "cpu").forward(ids).numpy()
    fast = deepinfer.compile(quantized, "sm90", fp8_activations=True).forward(ids).cpu().numpy()
    plain = deepinfer.compile(quantized, "sm90").forward(ids).cpu().numpy()
    error, plain_error = rel_l2(fast, exact), rel_l2(plain, exact)
    agree = float((fast.argmax(-1) == exact.argmax(-1)).mean())
    if os.environ.get("DEEPINFER_RESULTS_DIR"):  # bench/run_gpu.sh collects these for bench/RESULTS.md
        Path(os.environ["DEEPINFER_RESULTS_DIR"], "e2e_fp8_activations.json").write_text(json.dumps(
            {"rel": error, "argmax": agree, "bf16_products_rel": plain_error}))
    assert 1e-2 < error < 0.12 and agree >= 0.85 and plain_error < error / 2


def test_the_llm_and_the_command_line_pass_it_on(capsys) -> None:
    """`LLM(fp8_activations=True)` asks compile for it (the cpu target refuses it, naming why); the CLI has the flag."""
    from deepinfer import LLM
    from deepinfer.cli import main

    with pytest.raises(ValueError, match="fp8_activations"):
        LLM(fp8_activations=True)
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0 and "--fp8-activations" in capsys.readouterr().out
