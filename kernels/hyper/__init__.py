"""The hyper-connections family.

    mixes.py               the mixes (Sinkhorn), and the stream update made inside their first launch, in Triton
    hyper.py               collapse + RMSNorm, the stream update, in Triton
    collapse_tilelang.py   collapse + RMSNorm in TileLang
"""
