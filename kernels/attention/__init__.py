"""The attention family.

    sparse_attention.py   sparse attention with sink over gathered window + selected compressed entries
    paged_attention.py    the same attention reading the fp8 window rings and fp4 pools in place (decode and
                          verification chunks, eager and static steps)
    paged_entries.py      the in-place kernels' operand helpers: block tables, fp8/fp4 decoding in registers
    block_attention.py    DSpark's draft blocks: the window before each chunk, then the chunk's own keys, in place
"""
