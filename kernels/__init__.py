"""Kernel templates per target: `kernels.triton` (one family per file) and the launch hook they share.

Imports only `dsl`. The wrappers take torch tensors; each DSL op's reference is its oracle.
"""

from kernels.launch import Launch, launch, use_launcher

__all__ = ["Launch", "launch", "use_launcher"]
