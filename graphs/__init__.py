"""From a model graph and a target to something that runs: the plan (kernel and config per node), the
ahead-of-time cubin build, the artifact on disk, the CUDA-driver launcher, the executor, and the runtime: one
`CompiledModel` type for every target (graphs/compiled_model.py) over the interpreter or a plan.

Imports `dsl`, `kernels` and `autotune`.
"""

from graphs.passes import make_plan
from graphs.plan import BUCKETS, NodePlan, Plan, bucket_of

__all__ = ["Plan", "NodePlan", "make_plan", "bucket_of", "BUCKETS"]
