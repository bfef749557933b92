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

import torch

from graphs.aot import Built
from graphs.plan import Plan

FORMAT = 1


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


def read(path: str | Path) -> tuple[dict, Plan, dict[str, dict], dict[str, bytes], Plan | None]:
    """(manifest, plan, specs by launch key, cubins by launch key, draft plan or None) of a saved artifact."""
    root = Path(path)
    manifest = json.loads((root / "manifest.json").read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{root}: artifact format {manifest.get('format')}, this build reads {FORMAT}")
    plan_json = json.loads((root / "plan.json").read_text())
    specs, cubins = {}, {}
    for key, file_id in plan_json["kernels"].items():
        specs[key] = json.loads((root / "kernels" / f"{file_id}.json").read_text())
        cubins[key] = (root / "kernels" / f"{file_id}.cubin").read_bytes()
    draft_plan = None
    if manifest.get("drafting"):
        draft_plan = Plan.from_json(json.loads((root / "draft_plan.json").read_text()))
    return manifest, Plan.from_json(plan_json), specs, cubins, draft_plan


__all__ = ["save", "read", "config_hash", "FORMAT"]
