"""Triton kernels, one family per file: @triton.jit kernels and their torch-facing wrappers.

    linear.py     decode/skinny linear over bf16/fp32 or fp8 32x32-block weights, grouped (wo_a), split-K
    rms_norm.py   RMSNorm
    hyper.py      hyper-connection mixes (Sinkhorn), collapse + RMSNorm, stream update
    moe.py        routed experts: grouped GEMMs over fp4 (dequantized in registers) or bf16 weights
    moe_gate.py   the MoE gate after its projection: scores, biased top-k, weights
    moe_route.py  the routed experts' layout: the gate's picks sorted by expert into blocks
    attention.py  sparse attention with sink over gathered window + selected compressed entries
    indexer.py    the sparse indexer's scores of queries against their chunk's compressed keys
    topk.py       the indexer's selection: top-k entries of a row, candidate blocks (radix select per row)

Each wrapper checks its inputs, allocates outputs, returns early on empty input and launches through
`kernels.launch`; the DSL op of the same name (`dsl/ops`) is its reference. Tensors on the CPU run under
Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks them. Import the wrappers from their
modules (`from kernels.triton.linear import linear`): the package re-exports nothing, so each module name stays a
module.
"""
