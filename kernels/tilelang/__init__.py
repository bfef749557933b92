"""TileLang kernels, one family per file: a `TileLangKernel` (its TileLang program, built ahead of time to cubins)
and its torch-facing wrapper.

    kernel.py     the TileLangKernel that wrappers launch through `kernels.launch`
    build.py      tilelang.lower to CUDA source, nvcc to a cubin for sm_90a / sm_100a, no GPU needed
    rms_norm.py   RMSNorm
    hyper.py      hyper-connection collapse + RMSNorm

TileLang is imported only to build (kernels/tilelang/build.py and inside each program); importing the wrappers, and
running prebuilt cubins, needs torch alone. Under the default launcher (no artifact) a TileLang launch runs its torch
equivalent. Import the wrappers from their modules (`from kernels.tilelang.rms_norm import rms_norm`).
"""
