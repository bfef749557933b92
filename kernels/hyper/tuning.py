"""Tuning the hyper-connections' mixes: their space, a job on fresh random streams, the shape of a DeepSeek-V4.1
config."""

from __future__ import annotations

import itertools

import torch

import kernels.hyper.mixes as mixes
from dsl.ops import hyper as reference
from kernels.hyper.lowering import HC_MIXES, StreamsStatic
from kernels.tuning import Job, Tuning


def mixes_configs(static: StreamsStatic, bucket: int, target: str) -> list[dict]:
    """Decode buckets: 16 tokens a program and K split 4 to 64 ways (few tokens fill the GPU only so); prefill
    buckets: 32 or 64 tokens a program (each tile of the projection read from L2 serves more of them), little or
    no split."""
    if bucket <= 64:
        grid = itertools.product([16], [32, 64], [4, 8, 16, 32, 64], [4], [2, 3])
    else:
        grid = itertools.product([32, 64], [32, 64], [1, 2, 4], [4, 8], [2, 3])
    return [{"block_M": bm, "block_K": bk, "split_k": s, "num_warps": w, "num_stages": st}
            for bm, bk, s, w, st in grid if static.hc * static.d // s >= bk]


def mixes_job(st: StreamsStatic, m: int, fields: dict) -> Job:
    hc, d = st.hc, st.d
    args = (torch.randn(m, hc, d, device="cuda"), torch.randn((2 + hc) * hc, hc * d, device="cuda") * (hc * d) ** -0.5,
            torch.rand(3, device="cuda") + 0.5, torch.randn((2 + hc) * hc, device="cuda"))
    ref = torch.cat([t.reshape(m, -1) for t in reference.hc_mixes(*args, iters=20, eps=1e-6, norm_eps=1e-20)], 1)
    return (lambda c: torch.cat([t.reshape(m, -1) for t in mixes.hc_mixes(*args, iters=20, eps=1e-6, norm_eps=1e-20,
                                                                          config=c)], 1)), ref, 1e-4


TUNINGS = (Tuning(HC_MIXES.template, mixes_configs, mixes_job,
                  lambda f: [StreamsStatic(f["hc_mult"], f["hidden_size"])]),)

__all__ = ["TUNINGS", "mixes_configs", "mixes_job"]
