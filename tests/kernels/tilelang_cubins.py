"""TileLang cubins for the GPU tests and the benchmark: built here when TileLang can build (graphs.aot's cache), else
read from $DEEPINFER_ARTIFACTS/tilelang, written on a machine that can (the GPU machine has no TileLang):

    python -m tests.kernels.tilelang_cubins .prebuilt/tilelang     # no GPU needed; carry .prebuilt to the device
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from graphs.aot import build, kernel_source
from kernels.hyper.collapse_tilelang import hc_collapse_rms_norm
from kernels.launch import Launch, use_launcher
from kernels.norm.rms_norm_tilelang import rms_norm
from kernels.tilelang_build import available
from tests.kernels.cases import HIDDEN, Q_LORA

ROOT = Path(__file__).resolve().parents[2]
# rms_norm widths: V4.1-Flash's q_norm (q_lora_rank), kv_norm and the compressor's (head_dim), the indexer's k_norm
# (index_head_dim), DSpark's main_norm (hidden); 40: the fixtures' head_dim, not a multiple of a row's threads
NORM_WIDTHS = [HIDDEN, Q_LORA, 512, 128, 40]
NORM_CASES = [(d, dtype, has_w) for d in NORM_WIDTHS
              for dtype, has_w in ((torch.float32, True), (torch.bfloat16, False))]
HC_CASES = [(4, HIDDEN), (4, 64), (4, 40)]  # (hc_mult, hidden): V4.1-Flash's, the fixtures', 40 as above


def record(calls: Callable[[], None]) -> dict[str, Launch]:
    """The launches `calls()` makes (run it on meta tensors), by key."""
    found: dict[str, Launch] = {}
    with use_launcher(lambda call: found.setdefault(call.key(), call)):
        calls()
    return found


def launches() -> dict[str, Launch]:
    """Every TileLang variant the GPU tests and the benchmark launch."""
    def calls() -> None:
        for d, dtype, has_w in NORM_CASES:
            w = torch.empty(d, device="meta") if has_w else None
            rms_norm(torch.empty(7, d, dtype=dtype, device="meta"), w, eps=1e-20)
        for hc, d in HC_CASES:
            hc_collapse_rms_norm(torch.empty(7, hc, d, device="meta"), torch.empty(7, hc, device="meta"),
                                 torch.empty(d, device="meta"), eps=1e-20)
    return record(calls)


def cubins(launches: dict[str, Launch], target: str = "sm90") -> tuple[dict[str, dict], dict[str, bytes]] | None:
    """(specs, cubins) by launch key for `launches`: built here, or prebuilt from the same kernel source; None where
    neither can be had."""
    if available():
        built = build(launches, target)
        return {k: b.spec for k, b in built.items()}, {k: b.cubin for k, b in built.items()}
    root = Path(os.environ.get("DEEPINFER_ARTIFACTS", ROOT / ".prebuilt"), "tilelang")
    index = json.loads((root / "index.json").read_text()) if (root / "index.json").exists() else {}
    if not set(launches) <= set(index):
        return None
    specs = {k: json.loads((root / f"{index[k]}.json").read_text()) for k in launches}
    if any(specs[k]["source_sha256"] != hashlib.sha256(kernel_source(c.kernel).encode()).hexdigest()
           for k, c in launches.items()):
        return None  # built from another version of the kernel: build them again
    return specs, {k: (root / f"{index[k]}.cubin").read_bytes() for k in launches}


@functools.cache
def cubin_launcher():
    """A CubinLauncher over `launches()`' cubins, or None where they can be neither built nor read."""
    from graphs.launcher import CubinLauncher

    found = cubins(launches())
    return None if found is None else CubinLauncher(*found)


def save(root: Path, launches: dict[str, Launch], target: str = "sm90") -> None:
    root.mkdir(parents=True, exist_ok=True)
    built = build(launches, target)
    for b in built.values():
        (root / f"{b.file_id}.cubin").write_bytes(b.cubin)
        (root / f"{b.file_id}.json").write_text(json.dumps(b.spec, indent=1))
    (root / "index.json").write_text(json.dumps({k: b.file_id for k, b in built.items()}, indent=1))
    print(f"{len(built)} TileLang cubins for {target} in {root}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=str(ROOT / ".prebuilt" / "tilelang"), help="where the cubins go")
    out = parser.parse_args().out
    if not available():
        sys.exit("TileLang cannot build here (tilelang and nvcc needed)")
    save(Path(out), launches())
