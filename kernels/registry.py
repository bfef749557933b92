"""The kernel families' registry: the single source of what the rest of the code knows about them.

A family is a folder kernels/<family>/ whose lowering.py lists its lowerings (`LOWERINGS`) and whose tuning.py, where
it has one, what the tuner needs (`TUNINGS`). They are found here, not listed: adding a family touches its folder, its
op (dsl/ops/) and its tests. From them come the op -> lowering table the planner, the executor and the ahead-of-time
builder use (`LOWERINGS`), the template -> lowering table whose `sources` the tuning cache hashes (`TEMPLATES`), the
tuning spaces and jobs of autotune/ (`TUNINGS`), and which backends this machine can build (`buildable`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
from pathlib import Path
from types import ModuleType

from kernels.lowering import TILELANG, Lowering
from kernels.tuning import Tuning

logger = logging.getLogger(__name__)


def families() -> list[str]:
    """The names of the kernel families, in alphabetical order: the packages of kernels/ with a lowering.py. Listed
    from this file's folder, not from the `kernels` module: outside this repository an editable install can leave
    another distribution's top-level `kernels` in that name (Hugging Face's, which transformers requires), while each
    `kernels.<family>` still imports from here."""
    return [m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.ispkg
            and importlib.util.find_spec(f"kernels.{m.name}.lowering") is not None]


def _modules(name: str) -> list[ModuleType]:
    return [importlib.import_module(f"kernels.{family}.{name}") for family in families()
            if importlib.util.find_spec(f"kernels.{family}.{name}") is not None]


def _tables() -> tuple[dict[str, Lowering], dict[str, Lowering], dict[str, Tuning]]:
    ops: dict[str, Lowering] = {}
    templates: dict[str, Lowering] = {}
    for module in _modules("lowering"):
        for lowering in module.LOWERINGS:
            for op in lowering.ops:
                if op in ops:
                    raise ValueError(f"op {op!r} has two lowerings: {ops[op].template} and {lowering.template}")
                ops[op] = lowering
            templates.setdefault(lowering.template, lowering)  # rope and rope_entries share one
    tunings = {t.template: t for module in _modules("tuning") for t in module.TUNINGS}
    unknown = sorted(set(tunings) - set(templates))
    if unknown:
        raise ValueError(f"tuning for templates no lowering has: {', '.join(unknown)}")
    return ops, templates, tunings


LOWERINGS, TEMPLATES, TUNINGS = _tables()


def tunable() -> list[str]:
    """The templates the tuner measures (those whose tuning has a job), in family order."""
    return [template for template, t in TUNINGS.items() if t.job is not None]


_said: set[str] = set()


def buildable(backend: str) -> bool:
    """Whether this machine can build kernels of `backend` (TileLang: tilelang and an nvcc found, not turned off by
    DEEPINFER_TILELANG=0); said once in a log line when it cannot."""
    if backend != TILELANG:
        return True
    from kernels.tilelang_build import available

    if available():
        return True
    if backend not in _said:
        _said.add(backend)
        logger.warning("TileLang kernels cannot be built here (no tilelang, or no nvcc, or DEEPINFER_TILELANG=0): "
                       "plans take each template's next backend of the target")
    return False


__all__ = ["LOWERINGS", "TEMPLATES", "TUNINGS", "buildable", "families", "tunable"]
