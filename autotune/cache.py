"""The persistent tuning cache: a JSON file of the best config per (template, static shapes, token bucket, target,
device name, kernel-source hash). A source change or another device misses the cache and falls back to the
kernel's heuristic."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
from pathlib import Path

from kernels.lang import pdl_prologue
from kernels.registry import TEMPLATES

TUNED_DIR = Path(__file__).parent / "tuned"


def source_hash(module) -> str:
    """sha256 (16 hex) of the Triton kernels a module defines (their source, not the wrappers or heuristics):
    an edit to a kernel invalidates its tuned configs; an edit to a heuristic does not.

    The launch-ordering prologue (`kernels.lang.pdl_prologue`, its call lines and the imported helper) is left out:
    it decides when a kernel's blocks start, before any of the tile's work, so it does not change which config is
    fastest."""
    kernels = sorted((name, getattr(obj, "fn", None)) for name, obj in vars(module).items()
                     if callable(getattr(obj, "fn", None)) and hasattr(obj, "arg_names") and obj is not pdl_prologue)
    text = "".join(_without_prologue(inspect.getsource(fn)) for _, fn in kernels) if kernels \
        else inspect.getsource(module)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _without_prologue(source: str) -> str:
    return "".join(line for line in source.splitlines(keepends=True) if line.strip() != "pdl_prologue()")


@functools.cache
def template_hash(template: str) -> str:
    """The hash of the kernels that serve `template`: each of its lowering's `sources` modules' `source_hash`, in order
    (a template served by TileLang or Triton has both, so an edit to either invalidates its configs)."""
    return "".join(source_hash(module) for module in TEMPLATES[template].sources)


def cache_key(template: str, static: dict, bucket: int, target: str, device: str, src_hash: str) -> str:
    shapes = ",".join(f"{k}={static[k]}" for k in sorted(static))
    return f"{template}|{shapes}|m<={bucket}|{target}|{device}|{src_hash}"


class TuningCache:
    """Configs by `cache_key`, loaded from and saved to one JSON file."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.entries: dict[str, dict] = {}
        if self.path is not None and self.path.exists():
            self.entries = json.loads(self.path.read_text())["configs"]

    def get(self, key: str) -> dict | None:
        entry = self.entries.get(key)
        return None if entry is None else dict(entry["config"])

    def put(self, key: str, config: dict, us: float | None = None) -> None:
        self.entries[key] = {"config": dict(config), "us": us}

    def save(self) -> None:
        if self.path is None:
            raise ValueError("this cache has no file")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"configs": self.entries}, indent=1, sort_keys=True) + "\n")


def default_cache(target: str) -> TuningCache:
    """The committed tuning file of a target (autotune/tuned/<target>.json), or $DEEPINFER_TUNING."""
    return TuningCache(os.environ.get("DEEPINFER_TUNING") or TUNED_DIR / f"{target}.json")


__all__ = ["TuningCache", "cache_key", "default_cache", "source_hash", "template_hash"]
