"""The MoE family: the gate's scores and top-k after its projection, the routing of tokens to experts, the routed
experts' grouped GEMMs.

    experts.py    routed experts: grouped GEMMs over fp4 (dequantized in registers) or bf16 weights, SwiGLU, the sum
    expert_parallel.py  the routed experts split over ranks: pairs exchanged with all_to_all_single, summed in order
    gate.py       the gate after its projection: scores, biased top-k, weights
    route.py      the experts' layout: the gate's picks sorted by expert into blocks
"""
