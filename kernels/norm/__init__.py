"""The RMSNorm family.

    rms_norm.py            RMSNorm in Triton
    rms_norm_tilelang.py   RMSNorm in TileLang
    e4m3.py                RMSNorm, and collapse + RMSNorm, written as e4m3 rows for the fp8 linears that read them
"""
