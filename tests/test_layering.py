"""DESIGN.md's layering: dsl <- kernels <- autotune <- graphs <- deepinfer; data flows one way. And one target
table: only kernels/targets.py names a target.

Every .py under the five packages is parsed (ast, nothing imported); absolute imports, relative imports resolved
against the file's package, and `importlib.import_module("...")` / `__import__("...")` with a literal name count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dsl", "kernels", "autotune", "graphs", "deepinfer")
ALLOWED = {
    "dsl": set(),
    "kernels": {"dsl"},
    "autotune": {"dsl", "kernels"},
    "graphs": {"dsl", "kernels", "autotune"},
    "deepinfer": {"dsl", "kernels", "autotune", "graphs"},
}


def module_parts(path: Path) -> list[str]:
    """A file's dotted name relative to the repository root, as parts: kernels/triton/x.py -> [kernels, triton, x]."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def imported_modules(source: str, parts: list[str], is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, relative ones resolved.

    `parts` is the module's own dotted name; a relative import of level k starts from its package (the module
    itself when `is_package`) and climbs k - 1 levels. Climbing past the repository root raises ValueError.
    """
    package = parts if is_package else parts[:-1]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.append((node.lineno, node.module or ""))
                continue
            if node.level - 1 >= len(package):
                raise ValueError(f"line {node.lineno}: relative import climbs above the repository root")
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                found.append((node.lineno, ".".join(base + node.module.split("."))))
            else:  # `from . import a, b` imports the submodules a and b
                found += [(node.lineno, ".".join(base + [alias.name])) for alias in node.names]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
                found.append((node.lineno, arg.value))
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def violations(source: str, parts: list[str], is_package: bool) -> list[str]:
    """The imports of a module of package parts[0] that the layering forbids, as readable lines."""
    own, bad = parts[0], []
    for line, name in imported_modules(source, parts, is_package):
        top = name.split(".")[0]
        if top in PACKAGES and top != own and top not in ALLOWED[own]:
            bad.append(f"{'.'.join(parts)}:{line} imports {name} ({own} may import {sorted(ALLOWED[own]) or 'none'})")
    return bad


def project_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py") if "__pycache__" not in p.parts)


def test_the_packages_exist_and_hold_code() -> None:
    files = project_files()
    assert {p.relative_to(ROOT).parts[0] for p in files} == set(PACKAGES)


@pytest.mark.parametrize("path", project_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_respect_the_layering(path: Path) -> None:
    source = path.read_text(encoding="utf-8")
    assert violations(source, module_parts(path), path.name == "__init__.py") == []


# The checker itself, on sources written for it: each case could pass or fail.
@pytest.mark.parametrize("package,source,is_bad", [
    ("dsl", "import torch\nimport sympy", False),
    ("dsl", "import deepinfer.config", True),
    ("dsl", "from kernels.triton import x", True),
    ("kernels", "from dsl.ops import matmul", False),
    ("kernels", "from ..graphs import plan", False),  # kernels.graphs: relative imports stay in their package
    ("kernels", "from . import other_kernel", False),
    ("autotune", "import kernels, dsl", False),
    ("autotune", "from graphs.plan import Plan", True),
    ("graphs", "from autotune import cache\nfrom kernels import t\nfrom dsl import g", False),
    ("graphs", "def f():\n    from deepinfer import config\n", True),
    ("graphs", "import importlib\nimportlib.import_module('deepinfer.llm')", True),
    ("dsl", "__import__('graphs')", True),
    ("deepinfer", "from graphs import plan\nfrom dsl import graph\nfrom .config import X", False),
])
def test_checker_flags_exactly_the_forbidden_imports(package: str, source: str, is_bad: bool) -> None:
    parts = [package, "sub", "mod"]  # a module two levels down, so `..` reaches the package itself
    assert bool(violations(source, parts, is_package=False)) == is_bad


def test_relative_imports_resolve_against_the_package() -> None:
    assert imported_modules("from .b import c", ["kernels", "triton", "a"], False) == [(1, "kernels.triton.b")]
    assert imported_modules("from .b import c", ["kernels", "triton"], True) == [(1, "kernels.triton.b")]
    assert imported_modules("from .. import g, h", ["kernels", "triton", "a"], False) == [(1, "kernels.g"),
                                                                                        (1, "kernels.h")]
    # Three dots from kernels/triton/a.py would leave `kernels`: Python refuses, and so does the checker.
    with pytest.raises(ValueError, match="climbs above"):
        imported_modules("from ... import graphs", ["kernels", "triton", "a"], False)


# ---- the target table: the one place that names a target -------------------------------------------------------

TARGET_TABLE = ROOT / "kernels" / "targets.py"
ARCH_NAME = re.compile(r"sm_\d+a?")


def _mentions_target(node: ast.AST) -> bool:
    """Whether an expression is about a target: a name, attribute or call naming `target`."""
    return any(isinstance(n, ast.Name) and "target" in n.id.lower()
               or isinstance(n, ast.Attribute) and "target" in n.attr.lower() for n in ast.walk(node))


def target_strings(source: str, names: set[str], device_types: set[str]) -> list[str]:
    """Where `source` names a target as a string: a literal equal to a target's name or an architecture (sm_90a);
    a name that is also a torch device type ("cpu") only where it is compared with, passed as or defaults a
    target."""
    def literal(node: ast.AST) -> str | None:
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    found = []
    for node in ast.walk(ast.parse(source)):
        value = literal(node)
        if value is not None and (value in names - device_types or ARCH_NAME.fullmatch(value)):
            found.append(f"line {node.lineno}: {value!r}")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            hits = [literal(s) for s in sides if literal(s) in names & device_types]
            if hits and any(_mentions_target(s) for s in sides if literal(s) is None):
                found.append(f"line {node.lineno}: {hits[0]!r} compared with a target")
        elif isinstance(node, ast.keyword) and node.arg and "target" in node.arg and literal(node.value) in names:
            found.append(f"line {node.value.lineno}: {node.arg}={literal(node.value)!r}")
        elif isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            pairs = list(zip(args[len(args) - len(node.defaults):], node.defaults))
            pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
            found += [f"line {d.lineno}: {a.arg}={literal(d)!r}" for a, d in pairs
                      if "target" in a.arg and literal(d) in names]
        elif isinstance(node, ast.Call) and node.args and literal(node.args[0]) == "--target":
            found += [f"line {k.value.lineno}: --target default {literal(k.value)!r}" for k in node.keywords
                      if k.arg == "default" and literal(k.value) in names]
    return found


def _target_names() -> tuple[set[str], set[str]]:
    from kernels.targets import TARGETS

    return set(TARGETS), {"cpu", "cuda", "meta", "mps", "npu", "xpu"} & set(TARGETS)


@pytest.mark.parametrize("path", [p for p in project_files() if p != TARGET_TABLE],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_target_table_names_targets(path: Path) -> None:
    names, device_types = _target_names()
    assert target_strings(path.read_text(encoding="utf-8"), names, device_types) == []


@pytest.mark.parametrize("source,is_bad", [
    ("x = 'sm90'", True),
    ("arch = 'sm_90a'", True),
    ("if spec.target == 'cpu':\n    pass", True),
    ("if 'cpu' != self.target:\n    pass", True),
    ("compile(model, target='cpu')", True),
    ("def f(target: str = 'cpu'):\n    pass", True),
    ("def f(*, target='sm100'):\n    pass", True),
    ("p.add_argument('--target', default='cpu')", True),
    ("t = torch.device('cpu')\nif x.device.type == 'cpu':\n    pass", False),  # device strings are not targets
    ("def f(device: str = 'cpu'):\n    pass", False),
    ('"""Runs on sm90 and sm_90a cubins."""', False),  # prose may name them
])
def test_target_checker_flags_exactly_the_target_strings(source: str, is_bad: bool) -> None:
    names, device_types = _target_names()
    assert bool(target_strings(source, names, device_types)) == is_bad
