"""Programmatic dependent launch (kernels.lang.pdl_prologue, graphs/launcher.py), checked without a GPU: every kernel
begins with the prologue, and a cubin is marked for launching with programmatic stream serialization only when its
code waits for the grids before it ahead of any global memory access. The GPU side (the same bits with and without
it, eager and captured) is tests/test_gpu_pdl.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from graphs.aot import _waits_for_grid
from tests.test_gpu_targets import run_python

KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The statements of a function after its docstring."""
    first = fn.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                        str)
    return fn.body[1:] if docstring else fn.body


def _nodes(kind: type) -> list[tuple[str, ast.AST]]:
    """Every node of `kind` in kernels/, once, named by its file and line."""
    found = []
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind):
                found.append((f"{path.relative_to(KERNELS)}:{node.lineno}", node))
    return found


def test_every_triton_kernel_begins_with_the_prologue() -> None:
    kernels = [(name, fn) for name, fn in _nodes(ast.FunctionDef) if fn.name.endswith("_kernel")
               and any(ast.unparse(d).startswith("triton.jit") for d in fn.decorator_list)]
    assert len(kernels) >= 40
    missing = [name for name, fn in kernels if ast.unparse(_body(fn)[0]) != "pdl_prologue()"]
    assert missing == [], f"kernels whose first statement is not pdl_prologue(): {missing}"


def test_every_tilelang_kernel_begins_with_the_grid_wait() -> None:
    blocks = [(name, node) for name, node in _nodes(ast.With)
              if ast.unparse(node.items[0].context_expr).startswith("T.Kernel(")]
    assert len(blocks) >= 2  # kernels/norm/rms_norm_tilelang.py, kernels/hyper/collapse_tilelang.py
    missing = [name for name, block in blocks
               if [ast.unparse(s) for s in block.body[:2]] != ["T.pdl_sync()", "T.pdl_trigger()"]]
    assert missing == [], f"TileLang kernels not beginning with T.pdl_sync(), T.pdl_trigger(): {missing}"


ROPE = """
import json
import torch
from graphs.aot import compile_launch
from kernels.launch import Launch
from kernels.rope.rope import rope_kernel
x = torch.empty(4, 8, 64, dtype=torch.bfloat16, device="meta")  # [tokens, heads, head_dim]
pos = torch.empty(4, dtype=torch.int32, device="meta")
freqs = torch.empty(32, dtype=torch.float32, device="meta")
call = Launch(rope_kernel, (4, 1), (x, pos, freqs, x, 8),
              {"D": 64, "NOPE": 0, "MAGNITUDE": 1.0, "INVERSE": False, "block_R": 8, "block_D": 64})
built = compile_launch(call, "sm90")
print(json.dumps({"ptx": built.ptx, "spec": built.spec}))
"""


@pytest.fixture(scope="module")
def rope_ptx() -> tuple[str, dict]:
    """One real kernel compiled for sm90 (no GPU needed; Triton compiling, not its interpreter): its PTX and spec."""
    out = json.loads(run_python(ROPE, CUDA_VISIBLE_DEVICES=""))
    return out["ptx"], out["spec"]


def test_a_compiled_kernel_is_marked_for_programmatic_launch(rope_ptx) -> None:
    ptx, spec = rope_ptx
    assert spec["pdl"] is True
    assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def test_a_global_access_before_the_wait_or_no_wait_is_not_marked(rope_ptx) -> None:
    ptx, _ = rope_ptx
    wait = ptx.index("\tgriddepcontrol.wait")
    load = ptx[ptx.index("ld.global"):].splitlines()[0]
    for access in (load, "st.global.b32 [%rd1], %r1;", "atom.global.add.u32 %r2, [%rd1], 1;", "ld.u32 %r3, [%rd1];"):
        assert not _waits_for_grid(ptx[:wait] + f"\t{access}\n" + ptx[wait:]), access
    assert _waits_for_grid(ptx[:wait] + "\tld.param.u64 %rd9, [p];\n\tcvta.to.global.u64 %rd9, %rd9;\n" + ptx[wait:])
    assert not _waits_for_grid(ptx.replace("griddepcontrol.wait", "// no wait"))
    assert not _waits_for_grid("")


LAYOUT = r"""
#include <stdio.h>
#include <stddef.h>
#include <cuda.h>
int main(void) {
  printf("%zu %zu %d %zu %zu %zu %zu %zu\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, sizeof(CUlaunchConfig),
         offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
         offsetof(CUlaunchConfig, numAttrs));
  return 0;
}
"""


def test_the_launch_structs_match_cuda_h(tmp_path: Path) -> None:
    """graphs/launcher.py's ctypes CUlaunchConfig and CUlaunchAttribute against the driver header Triton ships."""
    import ctypes
    import os
    import shutil
    import subprocess

    import triton

    from graphs import launcher

    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None or not (include / "cuda.h").exists():
        pytest.skip("no C compiler or no cuda.h")
    (tmp_path / "layout.c").write_text(LAYOUT)
    subprocess.run([cc, f"-I{include}", str(tmp_path / "layout.c"), "-o", str(tmp_path / "layout")], check=True)
    got = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    attribute, config = launcher._LaunchAttribute, launcher._LaunchConfig
    assert [int(v) for v in got] == [
        ctypes.sizeof(attribute), attribute.value.offset, launcher._PROGRAMMATIC_STREAM_SERIALIZATION,
        ctypes.sizeof(config), config.shared.offset, config.stream.offset, config.attrs.offset,
        config.num_attrs.offset]
