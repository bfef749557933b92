"""Triton kernels, one family per file: @triton.jit kernels and their torch-facing wrappers.

    linear.py          decode/skinny linear over bf16/fp32 or fp8 32x32-block weights, grouped (wo_a), split-K
    linear_prefill.py  prefill linear: one bf16 wgmma GEMM over bf16 or fp8 32x32 weights
    linear_fp8.py      fp8 x fp8 linear: e4m3 activation rows (one scale a token) against per-row-scaled weights
    tiles.py           what the whole-output GEMMs share: tile order, a tile's product over K
    rms_norm.py        RMSNorm
    norm_e4m3.py       RMSNorm, and collapse + RMSNorm, written as e4m3 rows for the fp8 linears that read them
    hyper.py           hyper-connection mixes (Sinkhorn), collapse + RMSNorm, stream update
    rope.py            interleaved rotary embedding, over tokens or compressed entries
    rounding.py        fp8 and fp4 grids: values rounded onto a cache format and back
    cache.py           cache entries encoded and scattered into their pools, gathered and decoded
    compressor.py      the compressor's pooling of completed groups into entries
    engram.py          Engram's gate onto the streams
    engram_rows.py     Engram's n-gram hash and table gather (dequantized fp8 rows)
    moe.py             routed experts: grouped GEMMs over fp4 (dequantized in registers) or bf16 weights
    moe_gate.py        the MoE gate after its projection: scores, biased top-k, weights
    moe_route.py       the routed experts' layout: the gate's picks sorted by expert into blocks
    swiglu.py          the shared expert's clamped SwiGLU
    attention.py       sparse attention with sink over gathered window + selected compressed entries
    indexer.py         the sparse indexer's scores of queries against their chunk's compressed keys
    topk.py            the indexer's selection: top-k entries of a row, candidate blocks (radix select per row)
    sampling.py        seeded sampling's draw: hashed Gumbel noise, argmax over a row (greedy rows too)
    lang.py            Triton, or a stand-in where it is not installed (a saved artifact runs without it)

Each wrapper checks its inputs, allocates outputs, returns early on empty input and launches through
`kernels.launch`; the DSL op of the same name (`dsl/ops`) is its reference. Tensors on the CPU run under
Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks them. Import the wrappers from their
modules (`from kernels.triton.linear import linear`): the package re-exports nothing, so each module name stays a
module.
"""
