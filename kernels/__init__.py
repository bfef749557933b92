"""Kernel templates per target (Triton, TileLang): arrive with the GPU targets. Imports only `dsl`."""
