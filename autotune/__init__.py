"""Autotuning of kernel tiles: arrives with the GPU targets. Imports `dsl` and `kernels`."""
