"""The compiled artifact on disk, and loading it back.

    dir/manifest.json      format version, target, arch, model config hash, tool versions, counts
    dir/plan.json          the plan: per graph node its kernel (or the reference), static shapes, configs per bucket
    dir/draft_plan.json    the DSpark draft layers' plan, when compiled with drafting (manifest "drafting": true)
    dir/tuning.json        where each config came from (tuned or heuristic) per kernel node and bucket
    dir/kernels/<id>.cubin one per compiled variant, with <id>.json (its launch spec) and <id>.ptx (to read: not
                           loaded, and absent where the kernel came from a cache without it); a TileLang kernel's
                           CUDA source as <id>.cu

Running it needs torch and the CUDA driver only (`graphs.launcher`), plus this package's wrappers.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import NamedTuple

import torch

from graphs.aot import Built
from graphs.plan import Plan
from kernels.targets import TARGETS, cubin_targets

FORMAT = 2  # the layout above; an artifact of another format is compiled again

MANIFEST_FIELDS = {"format": int, "target": str, "model_config_hash": str, "model_dir": (str, type(None)),
                   "drafting": bool}
DRAFT_PLAN_FIELDS = {"target": str, "buckets": list, "dot_fp32": bool, "nodes": list}
PLAN_FIELDS = DRAFT_PLAN_FIELDS | {"kernels": dict}  # launch key -> file id in kernels/
SPEC_FIELDS = {"key": str, "name": str, "shared": int, "signature": list}  # what every launch reads
BACKEND_FIELDS = {"triton": {"num_warps": int, "global_scratch_size": int, "profile_scratch_size": int},
                  "tilelang": {"threads": int, "arg_order": list}}


class ArtifactError(ValueError):
    """A malformed artifact, or one whose files lead out of its directory: the message names the file."""


class Artifact(NamedTuple):
    manifest: dict
    plan: Plan
    specs: dict[str, dict]  # launch specs by launch key (`Launch.key()`)
    cubins: dict[str, bytes]  # by launch key
    draft_plan: Plan | None  # the DSpark draft layers' plan, where compiled with drafting


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save(path: str | Path, plan: Plan, built: dict[str, Built], model_config: dict, model_dir: str | None,
         draft_plan: Plan | None = None) -> Path:
    root = Path(path)
    (root / "kernels").mkdir(parents=True, exist_ok=True)
    index = {}
    for key, b in sorted(built.items()):
        (root / "kernels" / f"{b.file_id}.cubin").write_bytes(b.cubin)
        if b.ptx:
            (root / "kernels" / f"{b.file_id}.ptx").write_text(b.ptx)
        (root / "kernels" / f"{b.file_id}.json").write_text(json.dumps(b.spec, indent=1) + "\n")
        if b.source:
            (root / "kernels" / f"{b.file_id}.cu").write_text(b.source)
        index[key] = b.file_id
    (root / "plan.json").write_text(json.dumps(plan.to_json() | {"kernels": index}, indent=1) + "\n")
    if draft_plan is not None:  # its kernels are among plan.json's
        (root / "draft_plan.json").write_text(json.dumps(draft_plan.to_json(), indent=1) + "\n")
    tuning = {str(n.index): {"template": n.template, "static": n.static.fields(),
                             "sources": {str(b): p.source for b, p in n.buckets.items()}} for n in plan.kernel_nodes()}
    (root / "tuning.json").write_text(json.dumps(tuning, indent=1) + "\n")
    import triton

    manifest = {
        "format": FORMAT, "target": plan.target, "arch": next(iter(built.values())).spec["arch"] if built else None,
        "model_config_hash": config_hash(model_config), "model_dir": model_dir,
        "dot_fp32": plan.dot_fp32, "fp8_activations": plan.fp8_activations, "buckets": list(plan.buckets),
        "drafting": draft_plan is not None,
        "num_nodes": len(plan.nodes), "num_kernel_nodes": len(plan.kernel_nodes()), "num_cubins": len(built),
        "tools": {"triton": triton.__version__, "torch": torch.__version__, "python": platform.python_version()},
    }
    tilelang = sorted({b.spec["tilelang"] for b in built.values() if "tilelang" in b.spec})
    if tilelang:  # "tilelang 0.1.15, nvcc V13.0.88"
        manifest["tools"]["tilelang"] = tilelang[0] if len(tilelang) == 1 else tilelang
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return root


def read(path: str | Path) -> Artifact:
    """A saved artifact, every file checked: ArtifactError names the file and what is wrong with it. Every file read
    resolves (symlinks followed) strictly inside the artifact directory, and a kernel entry of plan.json names a
    file in kernels/, nothing else."""
    root = Path(path)
    if not root.is_dir():
        raise ArtifactError(f"{root}: no artifact directory there")
    root = root.resolve()
    manifest = _json(root, "manifest.json", MANIFEST_FIELDS)
    if manifest["format"] != FORMAT:
        raise ArtifactError(f"{root / 'manifest.json'}: artifact format {manifest['format']}, this build reads "
                            f"format {FORMAT}: compile the model again")
    target = TARGETS.get(manifest["target"])
    if target is None or not target.builds_cubins:
        raise ArtifactError(f"{root / 'manifest.json'}: target {manifest['target']!r} is none whose models this "
                            f"build saves ({', '.join(t.name for t in cubin_targets())})")
    plan_json = _json(root, "plan.json", PLAN_FIELDS)
    plan = _plan(root / "plan.json", plan_json)
    if plan.target != manifest["target"]:
        raise ArtifactError(f"{root / 'plan.json'}: planned for {plan.target}, but manifest.json says "
                            f"{manifest['target']}")
    specs, cubins = {}, {}
    for key, file_id in plan_json["kernels"].items():
        what = f"kernel entry {key!r} of plan.json"
        if not isinstance(file_id, str) or "/" in file_id or "\\" in file_id or file_id in ("", ".", ".."):
            raise ArtifactError(f"{root / 'plan.json'}: {what} names {file_id!r}, not a file name in kernels/")
        specs[key] = _spec(root, f"kernels/{file_id}.json", key, what)
        cubins[key] = _cubin(_inside(root, f"kernels/{file_id}.cubin", what))
    draft_plan = None
    if manifest["drafting"]:
        draft_plan = _plan(root / "draft_plan.json", _json(root, "draft_plan.json", DRAFT_PLAN_FIELDS))
    return Artifact(manifest, plan, specs, cubins, draft_plan)


def _inside(root: Path, name: str, what: str | None = None) -> Path:
    """`root / name` resolved, refused unless it is a file strictly inside `root` (itself resolved)."""
    path = root / name
    resolved = path.resolve()
    about = f" ({what})" if what else ""
    if not resolved.is_relative_to(root) or resolved == root:
        raise ArtifactError(f"{path}{about}: leaves the artifact directory {root} (it resolves to {resolved})")
    if not resolved.is_file():
        raise ArtifactError(f"{path}{about}: missing")
    return resolved


def _json(root: Path, name: str, fields: dict[str, type | tuple[type, ...]], what: str | None = None) -> dict:
    """The JSON object in `root / name`, with each of `fields` present and of its type."""
    path = _inside(root, name, what)
    data = _object(root / name, path)
    _fields(root / name, data, fields)
    return data


def _object(name: Path, path: Path) -> dict:
    """The JSON object in file `path` (`name` as the artifact lists it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ArtifactError(f"{name}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{name}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(data, dict):
        raise ArtifactError(f"{name}: a JSON object expected, found {type(data).__name__}")
    return data


def _fields(name: Path, data: dict, fields: dict[str, type | tuple[type, ...]]) -> None:
    """Each of `fields` present in `data` and of its type (a bool is no int)."""
    for key, kind in fields.items():
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if key not in data:
            raise ArtifactError(f"{name}: no {key!r}")
        value = data[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise ArtifactError(f"{name}: {key!r} is {value!r}, not {' or '.join(t.__name__ for t in kinds)}")


def _plan(path: Path, data: dict) -> Plan:
    try:
        return Plan.from_json(data)
    except KeyError as e:
        raise ArtifactError(f"{path}: a node has no {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError, IndexError) as e:
        raise ArtifactError(f"{path}: not a plan ({type(e).__name__}: {e})") from None


def _spec(root: Path, name: str, key: str, what: str) -> dict:
    """A kernel's launch spec: what the launcher reads, of its types, made for the launch `key`."""
    spec = _json(root, name, SPEC_FIELDS, what)
    backend = spec.get("backend", "triton")
    if backend not in BACKEND_FIELDS:
        raise ArtifactError(f"{root / name}: backend {backend!r}, not one of {', '.join(BACKEND_FIELDS)}")
    _fields(root / name, spec, BACKEND_FIELDS[backend])
    if spec["key"] != key:
        raise ArtifactError(f"{root / name}: the launch spec of {spec['key']!r}, but plan.json lists it for {key!r}")
    if not all(isinstance(t, str) for t in spec["signature"]):
        raise ArtifactError(f"{root / name}: 'signature' holds {spec['signature']!r}, not argument type names")
    return spec


def _cubin(path: Path) -> bytes:
    data = path.read_bytes()
    if not data.startswith(b"\x7fELF"):
        raise ArtifactError(f"{path}: not a cubin (no ELF header)")
    return data


__all__ = ["FORMAT", "Artifact", "ArtifactError", "config_hash", "read", "save"]
