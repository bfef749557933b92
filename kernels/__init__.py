"""Kernels, one folder per family (kernels/<family>/: its Triton and TileLang kernels with their torch-facing
wrappers, its lowering.py, and where it is tuned its space.py and tuning.py), and what the families share: what a
lowering is (lowering.py), what tuning needs (tuning.py), the registry every other table derives from (registry.py),
the launch hook (launch.py), Triton or its stand-in where it is not installed (lang.py, so a saved artifact runs
without it), the whole-output GEMMs' tiles (tiles.py), TileLang kernels and their ahead-of-time build
(tilelang_kernel.py, tilelang_build.py), the target table (targets.py).

Imports only `dsl`. Each wrapper checks its inputs, allocates outputs, returns early on empty input and launches
through `kernels.launch`; the DSL op of the same name (dsl/ops) is its reference. Tensors on the CPU run under
Triton's interpreter (`TRITON_INTERPRET=1`), which is how CI checks them. TileLang is imported only to build
(tilelang_build.py and inside each program): importing the wrappers, and running prebuilt cubins, needs torch alone;
under the default launcher a TileLang launch runs its torch equivalent. Import a wrapper from its module
(`from kernels.linear.linear import linear`): the packages re-export nothing, so each module name stays a module.
"""

from kernels.launch import Launch, launch, use_launcher

__all__ = ["Launch", "launch", "use_launcher"]
