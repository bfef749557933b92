"""Tuning the decode GEMM (linear.py): its space, a job on fresh random weights and tokens, and the projections of a
DeepSeek-V4.1 config."""

from __future__ import annotations

import torch

import kernels.linear.linear as linear
from dsl.ops import dense
from dsl.quant import quantize_fp8_block
from kernels.linear.lowering import LINEAR, LinearStatic
from kernels.linear.space import linear_configs
from kernels.tuning import Job, Tuning, rotation


def linear_job(st: LinearStatic, m: int, fields: dict) -> Job:
    n, k, groups = st.n, st.k, st.groups
    w = torch.randn(groups * n, k, device="cuda") * k**-0.5
    w, s = quantize_fp8_block(w) if st.fmt == "fp8" else (w.bfloat16(), None)
    x = torch.randn(m, groups * k, device="cuda")
    xr = x.bfloat16().float()
    ref = dense.linear(xr, w, s) if groups == 1 else dense.grouped_linear(xr, w, s, groups=groups)
    copies = rotation(w)  # equal copies past the L2: each call streams its weight from HBM, as in a model
    step = iter(range(1 << 62))
    return (lambda c: linear.linear(x, copies[next(step) % len(copies)], s, groups=groups, config=c)), ref, 1e-4


def linear_shapes(fields: dict) -> list[LinearStatic]:
    """wq_a, wq_b, wkv (and the compressor's wkv / wgate), wo_a, wo_b, the indexer's wq_b (checkpoints store these in
    fp8, tests in float), then the always-float indexer weights_proj and head."""
    h, heads, d = fields["hidden_size"], fields["num_attention_heads"], fields["head_dim"]
    g, r, q = fields["o_groups"], fields["o_lora_rank"], fields["q_lora_rank"]
    both, plain = ("plain", "fp8"), ("plain",)
    linears = [(q, h, 1, both), (heads * d, q, 1, both), (d, h, 1, both), (r, heads // g * d, g, both),
               (h, g * r, 1, both), (fields["index_n_heads"] * fields["index_head_dim"], q, 1, both),
               (fields["index_n_heads"], h, 1, plain), (fields["vocab_size"], h, 1, plain)]
    out: list[LinearStatic] = []
    for n, k, groups, fmts in linears:
        out += [st for st in (LinearStatic(n, k, groups, fmt) for fmt in fmts) if st not in out]
    return out


TUNINGS = (Tuning(LINEAR.template, linear_configs, linear_job, linear_shapes),)

__all__ = ["TUNINGS", "linear_job", "linear_shapes"]
