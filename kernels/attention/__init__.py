"""The attention family.

    sparse_attention.py   sparse attention with sink over gathered window + selected compressed entries
    paged_attention.py    the same attention reading the fp8 window rings and fp4 pools in place (decode and
                          verification chunks): its kernels and their launch wrapper
    paged_ops.py          the DSL op on that kernel, eager and in static steps: whether a step reads in place, which
                          chunks do, the kernel's operands from the cache views or the step's tensors
    paged_entries.py      the in-place kernels' operand helpers: block tables, fp8/fp4 decoding in registers
    block_attention.py    DSpark's draft blocks: the window before each chunk, then the chunk's own keys, in place
"""
