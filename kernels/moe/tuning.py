"""Tuning the routed experts and the gate's projection: their spaces, jobs on fresh random inputs, the shapes of a
DeepSeek-V4.1 config."""

from __future__ import annotations

from dataclasses import replace

import torch

import kernels.linear.linear as linear
import kernels.moe.experts as experts
from kernels.moe.fragments import fragment_codes
from kernels.moe.lowering import MOE_EXPERTS, MOE_GATE, ExpertsStatic, GateStatic
from kernels.moe.space import gate_configs, moe_configs
from kernels.tuning import Job, Tuning


def experts_job(st: ExpertsStatic, m: int, fields: dict) -> Job:
    e, inter, d, topk, dev = st.e, st.inter, st.d, st.topk, "cuda"
    shapes = ((inter, d), (d, inter), (inter, d))
    ws = [torch.randint(0, 256, (e, o, i // 2), device=dev, dtype=torch.uint8) for o, i in shapes]
    if st.fmt == "fp4_fragments":
        ws = [fragment_codes(w) for w in ws]
    ss = [experts.prescaled(torch.ldexp(torch.ones(e, o, i // 32, device=dev),
                                        torch.randint(-7, -3, (e, o, i // 32), device=dev)))
          for o, i in shapes]  # the forms the executor gives the kernel
    picks = torch.stack([torch.randperm(e, device=dev)[:topk] for _ in range(m)])
    weights = torch.rand(m, topk, device=dev)
    x = torch.randn(m, d, device=dev)
    args = (x, weights, picks, ws[0], ws[1], ws[2], ss[0], ss[1], ss[2])
    ref = experts.moe_experts(*args, limit=10.0, config=experts.default_config(m))
    return (lambda c: experts.moe_experts(*args, limit=10.0, config=c)), ref, 1e-3


def gate_job(st: GateStatic, m: int, fields: dict) -> Job:
    """fp32 weights and products, as the gate's lowering runs its projection."""
    w = torch.randn(st.e, st.d, device="cuda") * st.d ** -0.5
    x = torch.randn(m, st.d, device="cuda")
    ref = (x.double() @ w.double().t()).float()
    return (lambda c: linear.linear(x, w, config=c, dot_fp32=True)), ref, 1e-5


TUNINGS = (
    Tuning(MOE_GATE.template, gate_configs, gate_job,
           lambda f: [GateStatic(f["n_routed_experts"], f["hidden_size"])]),
    Tuning(MOE_EXPERTS.template, moe_configs, experts_job,
           # the codes as plans give them on the GPU the tuner runs on (Hopper: `ExpertsStatic`'s fragment order)
           lambda f: [ExpertsStatic(f["n_routed_experts"], f["moe_intermediate_size"], f["hidden_size"],
                                    f["num_experts_per_tok"], "fp4_fragments")],
           # the expert count is a runtime size: a few experts compile the same kernels
           warmup=lambda st: replace(st, e=min(st.e, 16))),
)

__all__ = ["TUNINGS", "experts_job", "gate_job"]
