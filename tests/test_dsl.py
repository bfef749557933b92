"""The DSL: building, shape inference over symbolic dims, verification, fusion and the IR dump."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sympy
import torch

from dsl.builder import GraphBuilder
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from dsl.passes import fuse, infer_shapes, run_passes, verify
from dsl.tensor import TensorType, num_tokens


def _streams_graph(hidden: int = 16, hc: int = 4):
    b = GraphBuilder()
    h = b.input("h", (num_tokens, hc, hidden), "float32")
    pre = b.param("pre", (hc,), "float32")
    w = b.param("norm", (hidden,), "float32")
    wo = b.param("proj", (8, hidden), "float32")
    x = b.rms_norm(b.hc_collapse(h, pre), w, eps=1e-6)
    b.output("y", b.linear(x, wo))
    return b.graph


def test_shapes_are_inferred_over_symbols() -> None:
    graph = infer_shapes(_streams_graph())
    y = graph.outputs["y"].type
    assert y == TensorType((num_tokens, 8), "float32")
    assert isinstance(y.shape[0], sympy.Symbol)


def test_verify_rejects_mismatched_linear() -> None:
    b = GraphBuilder()
    x = b.input("x", (num_tokens, 16), "float32")
    b.output("y", b.linear(x, b.param("w", (8, 12), "float32")))
    with pytest.raises(ValueError, match="input dim 16 does not match"):
        verify(infer_shapes(b.graph))


def test_verify_rejects_use_before_definition() -> None:
    graph = infer_shapes(_streams_graph())
    graph.nodes.reverse()
    with pytest.raises(ValueError, match="before it is defined"):
        verify(graph)


def test_fusion_rewrites_and_keeps_results() -> None:
    torch.manual_seed(0)
    inputs = {"h": torch.randn(5, 4, 16)}
    params = {"pre": torch.rand(4), "norm": torch.rand(16), "proj": torch.randn(8, 16)}
    ctx = ForwardContext([SequenceState()], [5])
    plain = interpret(verify(infer_shapes(_streams_graph())), inputs, params, ctx)["y"]
    fused_graph = run_passes(_streams_graph())
    assert [n.op for n in fused_graph.nodes] == ["hc_collapse_rms_norm", "linear"]
    fused = interpret(fused_graph, inputs, params, ctx)["y"]
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_fusion_skips_a_shared_intermediate() -> None:
    b = GraphBuilder()
    h = b.input("h", (num_tokens, 4, 16), "float32")
    x = b.hc_collapse(h, b.param("pre", (4,), "float32"))
    b.output("a", b.rms_norm(x, b.param("w", (16,), "float32"), eps=1e-6))
    b.output("b", x)
    graph = fuse(infer_shapes(b.graph))
    assert [n.op for n in graph.nodes] == ["hc_collapse", "rms_norm"]


def test_debug_ir_prints_every_pass() -> None:
    code = ("from dsl.passes import run_passes; import tests.test_dsl as t; run_passes(t._streams_graph())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DEEPINFER_DEBUG": "ir", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr
    for name in ("infer_shapes", "verify", "fuse"):
        assert f"// after {name}" in out.stderr
    assert "hc_collapse_rms_norm" in out.stderr
