"""The MoE family: the gate's scores and top-k after its projection, the routing of tokens to experts, the routed
experts' grouped GEMMs.

    experts.py    routed experts: grouped GEMMs over fp4 (dequantized in registers) or bf16 weights, SwiGLU, the sum
    raw_codes.py  fp4 expert codes as stored: their decoding and products
    fragments.py  fp4 expert codes in the order of wgmma's register fragments, and their decoding (sm90's plans)
    stages.py     one K stage of the fp4 GEMMs on either layout: activations, scale factor, products, the final wait
    exchange.py   expert parallelism: each (token, expert) pair to its expert's rank and back, all_to_all_single
    expert_parallel.py         the interpreter's routed experts over a rank's share, summed in expert order
    expert_parallel_kernel.py  the plan's MoE kernel over a rank's share, summed as one device sums
    gate.py       the gate after its projection: scores, biased top-k, weights
    route.py      the experts' layout: the gate's picks sorted by expert into blocks
"""
