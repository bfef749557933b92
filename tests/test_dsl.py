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


def _update_graph(weights_late: bool = False):
    """Streams updated by a sub-layer's two summed outputs, read by hc_mean, then by the next mixes (whose projection is
    a param, or with `weights_late` a value made after the update) and the next collapse."""
    b = GraphBuilder()
    h = b.input("h", (num_tokens, 4, 16), "float32")
    a, c = b.input("a", (num_tokens, 16), "float32"), b.input("c", (num_tokens, 16), "float32")
    post, comb = b.input("post", (num_tokens, 4), "float32"), b.input("comb", (num_tokens, 4, 4), "float32")
    new = b.hc_expand(b.add(a, c), h, post, comb)
    b.output("mean", b.hc_mean(new))
    fn = b.param("fn", (24, 64), "float32")
    if weights_late:
        fn = b.add(fn, fn)
    pre, post2, comb2 = b.hc_mixes(new, fn, b.param("scale", (3,), "float32"), b.param("base", (24,), "float32"),
                                   iters=20, eps=1e-6, norm_eps=1e-20)
    b.output("x", b.hc_collapse(new, pre))
    b.output("post", post2)
    b.output("comb", comb2)
    return b.graph


def test_an_update_and_the_mixes_of_its_streams_fuse_in_the_updates_place() -> None:
    """The add joins the update, and the mixes join it where the update was, before hc_mean (which reads the
    streams): the fused node makes the streams and the mixes; every output keeps its bits."""
    torch.manual_seed(0)
    inputs = {"h": torch.randn(3, 4, 16), "a": torch.randn(3, 16), "c": torch.randn(3, 16), "post": torch.rand(3, 4),
              "comb": torch.rand(3, 4, 4)}
    params = {"fn": torch.randn(24, 64) * 0.1, "scale": torch.rand(3) + 0.5, "base": torch.randn(24)}
    ctx = ForwardContext([SequenceState()], [3])
    plain = interpret(verify(infer_shapes(_update_graph())), inputs, params, ctx)
    graph = run_passes(_update_graph())
    assert [n.op for n in graph.nodes] == ["add_hc_expand_mixes", "hc_mean", "hc_collapse"]
    assert all(v.producer is graph.nodes[0] for v in graph.nodes[0].outputs)
    fused = interpret(graph, inputs, params, ctx)
    for name in ("mean", "x", "post", "comb"):
        torch.testing.assert_close(fused[name], plain[name], rtol=0, atol=0)


def test_an_update_stays_apart_from_mixes_whose_weights_come_after_it() -> None:
    graph = run_passes(_update_graph(weights_late=True))
    assert [n.op for n in graph.nodes] == ["add_hc_expand", "hc_mean", "add", "hc_mixes", "hc_collapse"]


def test_debug_ir_prints_every_pass() -> None:
    code = ("from dsl.passes import run_passes; import tests.test_dsl as t; run_passes(t._streams_graph())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"DEEPINFER_DEBUG": "ir", "PATH": ""}, cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr
    for name in ("infer_shapes", "verify", "fuse"):
        assert f"// after {name}" in out.stderr
    assert "hc_collapse_rms_norm" in out.stderr
