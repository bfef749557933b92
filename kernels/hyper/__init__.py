"""The hyper-connections family.

    hyper.py               the mixes (Sinkhorn), collapse + RMSNorm, the stream update, in Triton
    collapse_tilelang.py   collapse + RMSNorm in TileLang
"""
