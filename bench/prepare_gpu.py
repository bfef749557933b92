"""Build, on a machine without a GPU, what a device call should carry so the GPU compiles nothing: the cubins of every
model the GPU tests and benches compile (`.cubin-cache`, read through DEEPINFER_CACHE by bench/run_gpu.sh) and the
full-width slice's artifacts (`artifacts/slice-sm90`, and `artifacts/slice-sm90-fp8` with fp8 activations and the
prefill bucket only), without their PTX (no load reads it). Prints what the working tree plus these weigh against
the device's 64 MiB.

    python bench/prepare_gpu.py [--skip-slice] [--only-base] [--base COMMIT]
    then: run(command="... bash bench/run_gpu.sh", carry=[".cubin-cache", "artifacts/slice-sm90", ...])

`--base COMMIT` also makes what a side-by-side call needs (`SIDE=1 bash bench/run_gpu.sh`): `.base/`, the Python
packages of COMMIT (no checkpoints, no tests: about 2 MiB), and `artifacts/slice-sm90-base`, the slice's artifact as
that tree compiles it, so each tree runs its own kernels; carry both. `--only-base` builds those alone.

Each step runs in its own process: the tests' modules set TRITON_INTERPRET on import, which would turn the ahead-of-
time compiles into the interpreter's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MIB = 64
MODELS = ["deepinfer/checkpoints/v41-tiny-stdlib", "tests/fixtures/v41-smooth", "tests/fixtures/v41-smooth-engram",
          "tests/fixtures/v41-tiny", "tests/fixtures/v41-tiny-engram"]

QUANTIZE = """
import sys
from pathlib import Path
from deepinfer.config import DeepseekV41Config
from tests.conftest import fixture_dir
from tests.test_checkpoint import _quantize, _tensors, _write
config = DeepseekV41Config.from_pretrained(fixture_dir("v41-smooth"))
_write(Path(sys.argv[1]), _quantize(_tensors("v41-smooth"), config), fixture_dir("v41-smooth"))
"""

COMPILE = """
import sys
import deepinfer
from deepinfer.models import DeepseekV41Flash
for path in sys.argv[1:]:
    model = DeepseekV41Flash.from_pretrained(path)
    for options in ([{"drafting": True}, {}] if "stdlib" in path else [{}]):
        deepinfer.compile(model, target="sm90", **options)
    if path.endswith("quantized"):  # tests/test_fp8_activations.py's GPU test compiles both
        deepinfer.compile(model, target="sm90", fp8_activations=True)
    print("compiled", path, flush=True)
"""


def run(code_or_args: list[str], **env: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"DEEPINFER_TILELANG": "0"} | env
    subprocess.run([sys.executable, *code_or_args], cwd=ROOT, env=environ, check=True)


def mib(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


BASE_PACKAGES = ["autotune", "bench", "deepinfer", "dsl", "graphs", "kernels"]


def build_base(commit: str, tmp: str) -> list[Path]:
    """`.base/` (COMMIT's packages, its checkpoints left out) and `artifacts/slice-sm90-base` compiled by that tree."""
    base, artifact = ROOT / ".base", ROOT / "artifacts" / "slice-sm90-base"
    archive = subprocess.run(["git", "archive", commit, *BASE_PACKAGES], cwd=ROOT, capture_output=True)
    if archive.returncode:  # before anything is removed: a bad commit leaves the last base as it was
        raise SystemExit(f"--base {commit}: {archive.stderr.decode().strip()}")
    tree, built = Path(tmp) / "base", Path(tmp) / "slice-sm90-base"  # made aside, moved in place once whole
    tree.mkdir()
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    shutil.rmtree(tree / "deepinfer" / "checkpoints", ignore_errors=True)  # the embedded model: not the slice's
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "DEEPINFER_TILELANG": "0", "PYTHONPATH": str(tree), "DEEPINFER_CACHE": str(Path(tmp) / "base-cache")}
    subprocess.run([sys.executable, "bench/bench_slice.py", "--build-artifact", str(built)], cwd=tree, env=environ,
                   check=True)
    for made, path in ((tree, base), (built, artifact)):
        shutil.rmtree(path, ignore_errors=True)
        shutil.move(made, path)
    return [base, artifact]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-slice", action="store_true", help="only the cubin cache")
    p.add_argument("--base", metavar="COMMIT", help="also .base/ and artifacts/slice-sm90-base from COMMIT")
    p.add_argument("--only-base", action="store_true", help="with --base: build those alone")
    args = p.parse_args()
    if args.only_base and not args.base:
        p.error("--only-base needs --base COMMIT")
    if args.only_base:
        with tempfile.TemporaryDirectory() as tmp:
            carried = build_base(args.base, tmp)
        return report(carried)
    cache = ROOT / ".cubin-cache"
    shutil.rmtree(cache, ignore_errors=True)  # only this tree's kernels: stale cubins would travel for nothing
    with tempfile.TemporaryDirectory() as tmp:
        quantized = Path(tmp) / "quantized"
        quantized.mkdir()
        run(["-c", QUANTIZE, str(quantized)])
        run(["-c", COMPILE, *MODELS, str(quantized)], DEEPINFER_CACHE=str(cache))
        carried = [cache]
        if not args.skip_slice:
            slice_cache = str(Path(tmp) / "slice-cache")
            for name, extra in (("slice-sm90", []), ("slice-sm90-fp8", ["--fp8-activations", "--buckets", "8192"])):
                shutil.rmtree(ROOT / "artifacts" / name, ignore_errors=True)
                run(["bench/bench_slice.py", "--build-artifact", f"artifacts/{name}", *extra],
                    DEEPINFER_CACHE=slice_cache)
                carried.append(ROOT / "artifacts" / name)
        if args.base:
            carried += build_base(args.base, tmp)
    return report(carried)


def report(carried: list[Path]) -> int:
    """PTX dropped from what travels, and its size printed against the device's limit."""
    for path in carried:  # PTX is for people to read, and no load needs it: it would travel for nothing
        for ptx in path.rglob("*.ptx"):
            ptx.unlink()
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    tree = sum((ROOT / f).stat().st_size for f in tracked.decode().split("\0") if f and (ROOT / f).is_file()) / 2**20
    for path in carried:
        print(f"{path.relative_to(ROOT)}: {mib(path):.1f} MiB")
    total = tree + sum(mib(path) for path in carried)
    print(f"tracked files {tree:.1f} MiB; with the above {total:.1f} of the device's {LIMIT_MIB} MiB"
          + ("" if total < LIMIT_MIB else ": too much, carry fewer"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
