"""The linear family: projections over bf16/fp32 or fp8 32x32-block weights, and the shared expert.

    linear.py     the decode GEMM: skinny x @ W.T, grouped (wo_a), split-K, fp8 scales on x or on W
    prefill.py    the prefill GEMM: one bf16 wgmma GEMM over bf16 or fp8 32x32 weights (fp8 dequantized first)
    fp8.py        fp8 x fp8: e4m3 activation rows (one scale a token) against per-row-scaled weights
    swiglu.py     the shared expert's clamped SwiGLU between its projections
"""
