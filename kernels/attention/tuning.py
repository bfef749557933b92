"""Tuning the sparse attention: its space, a job over random entry lists of a window plus the selected entries'
width, the attention shape of a DeepSeek-V4.1 config."""

from __future__ import annotations

import torch

import kernels.attention.sparse_attention as attention
from kernels.attention.lowering import SPARSE_ATTENTION, HeadsStatic
from kernels.attention.space import attention_configs
from kernels.tuning import Job, Tuning


def attention_job(st: HeadsStatic, m: int, fields: dict) -> Job:
    h, d, s, dev = st.h, st.d, fields["sliding_window"] + fields["index_topk"], "cuda"
    q = torch.randn(m, h, d, device=dev).bfloat16()
    kv = torch.randn(m * 2 * s, d, device=dev).bfloat16()
    idx = torch.stack([torch.randperm(2 * s, device=dev)[:s] + 2 * s * i for i in range(m)]).int()
    sink = torch.randn(h, device=dev)
    ref = attention.sparse_attention(q.float(), kv.float(), idx, sink, scale=d**-0.5, dot_fp32=True)
    return (lambda c: attention.sparse_attention(q, kv, idx, sink, scale=d**-0.5, config=c)), ref, 1e-2


TUNINGS = (Tuning(SPARSE_ATTENTION.template, attention_configs, attention_job,
                  lambda f: [HeadsStatic(f["num_attention_heads"], f["head_dim"])]),)

__all__ = ["TUNINGS", "attention_job"]
