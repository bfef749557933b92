"""The compile targets: one record each, in one table that every switch on a target reads.

A target says how its kernels are made (`backends`, in the order of preference for a family that has several), for
which GPU architecture cubins are built (`arch`, `compute_capability`), whose tuning a compile on a machine without
that GPU uses (`tuning_device`), how much shared memory a block may take (`smem_per_block`, what config spaces are
filtered by), whether kernels may store weights in the order of its MMA's register fragments (`mma_fragments`), and
what runs a compiled model (`runtime`): the DSL's interpreter over every op's torch reference, or a plan of kernels
launched from cubins through the CUDA driver. Nothing else in the code names a target.
"""

from __future__ import annotations

from dataclasses import dataclass

INTERPRETER, PLAN = "interpreter", "plan"  # the two runtimes


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    runtime: str | None  # INTERPRETER, PLAN, or None: nothing runs it in this build
    backends: tuple[str, ...] = ()  # kernel languages, preferred first ("tilelang", "triton"); () for references only
    compute_capability: tuple[int, int] | None = None  # the GPU whose cubins are built (and on which tuning measures)
    tuning_device: str | None = None  # the device name whose tuned configs a compile here uses
    smem_per_block: int = 0  # bytes of shared memory one block may use
    runnable: bool = False  # whether this build runs the target's compiled models (else: built, not run)
    device_type: str = "cpu"  # the torch device type its compiled models run on
    # Hopper's wgmma reads its A operand from registers in an order the fp4 experts' codes are stored in, so the
    # decoded words land in the operand's registers with no shuffle (kernels/moe/fragments.py; checked on its
    # compiled code): other targets' MMAs keep their operands elsewhere, and their kernels read the raw codes
    mma_fragments: bool = False

    @property
    def is_built(self) -> bool:
        """Whether `compile` makes something for this target."""
        return self.runtime is not None

    @property
    def builds_cubins(self) -> bool:
        return self.runtime == PLAN

    @property
    def arch(self) -> str:
        """The cubins' architecture name, e.g. sm_90a (the `a`: Hopper's and Blackwell's arch-specific features)."""
        if self.compute_capability is None:
            raise ValueError(f"target {self.name!r} builds no cubins")
        major, minor = self.compute_capability
        return f"sm_{major}{minor}a"

    @property
    def triton_arch(self) -> int:
        """The architecture as Triton's `GPUTarget` takes it (90 for sm_90a)."""
        if self.compute_capability is None:
            raise ValueError(f"target {self.name!r} builds no cubins")
        major, minor = self.compute_capability
        return 10 * major + minor


TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("cpu", "every op's torch reference; runs anywhere", INTERPRETER, runnable=True),
    Target("sm90", "Hopper: Triton and TileLang kernels, sm_90a cubins", PLAN, ("tilelang", "triton"), (9, 0),
           "NVIDIA H200", 227 * 1024, runnable=True, device_type="cuda", mma_fragments=True),
    Target("sm100", "Blackwell: Triton and TileLang kernels, sm_100a cubins, built anywhere", PLAN,
           ("tilelang", "triton"), (10, 0), "NVIDIA B200", 227 * 1024, device_type="cuda"),
    Target("ascend950", "Huawei Ascend 950: reserved", None, device_type="npu"),
)}
DEFAULT_TARGET = "cpu"  # what `LLM()` and `deepinfer generate` compile for unless told otherwise
DEFAULT_GPU_TARGET = "sm90"  # the GPU target tuning and GPU tools default to


def get_target(name: str | Target) -> Target:
    """The record of target `name`; ValueError naming the known targets for any other name."""
    if isinstance(name, Target):
        return name
    target = TARGETS.get(name) if isinstance(name, str) else None
    if target is None:
        raise ValueError(f"unknown target {name!r}; targets are {', '.join(TARGETS)}")
    return target


def get_built_target(name: str | Target) -> Target:
    """The record of target `name`, which this build compiles for; NotImplementedError naming the built targets for
    a target the table has but this build does not (ValueError for a name it does not know)."""
    target = get_target(name)
    if not target.is_built:
        built = ", ".join(t.name for t in built_targets())
        raise NotImplementedError(f"target {target.name!r} ({target.description}) has no kernels in this build yet; "
                                  f"built targets: {built}")
    return target


def built_targets() -> list[Target]:
    """The targets `compile` builds for, in table order."""
    return [t for t in TARGETS.values() if t.is_built]


def cubin_targets() -> list[Target]:
    """The targets whose kernels are built to cubins."""
    return [t for t in TARGETS.values() if t.builds_cubins]


def target_of_capability(capability: tuple[int, int]) -> Target | None:
    """The cubin target for a GPU of this compute capability, if this build has one."""
    return next((t for t in cubin_targets() if t.compute_capability == tuple(capability)), None)


__all__ = ["DEFAULT_GPU_TARGET", "DEFAULT_TARGET", "INTERPRETER", "PLAN", "TARGETS", "Target", "built_targets",
           "cubin_targets", "get_built_target", "get_target", "target_of_capability"]
