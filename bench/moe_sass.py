"""The instruction mix of the fp4 MoE GEMMs' main loop, raw codes against codes in fragment order, from cubins built
here for sm_90a (no GPU needed) and read with cuobjdump: per GEMM, the loop around the wgmma instructions, counted
by opcode, with the loads' widths, and the writes to the registers of wgmma operands still in flight
(`operand_hazards`).

    python bench/moe_sass.py [--tokens 64] [--config '{"block_M": 16, "block_N": 64, ...}'] [--json out.json]

Run it without TRITON_INTERPRET (Triton's interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphs.aot import compile_launch  # noqa: E402
from kernels.launch import use_launcher  # noqa: E402
from kernels.lowering import meta  # noqa: E402
from kernels.moe.experts import moe_experts  # noqa: E402
from kernels.moe.fragments import UNIT  # noqa: E402

DECODE = {"block_M": 16, "block_N": 64, "block_K": 128, "num_warps": 4, "num_stages": 3}  # the tuned decode tiles
CUOBJDUMP = Path(sys.modules["triton"].__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
V41 = {"d": 5120, "inter": 2304, "e": 384, "topk": 6}


def gemm_launches(tokens: int, tiles: dict, fragments: bool, split_k: int = 1) -> list:
    """The two `moe_gemm_kernel` launches of V4.1's experts at `tokens`, with codes raw or in fragment order."""
    d, inter, e, topk = V41["d"], V41["inter"], V41["e"], V41["topk"]
    if fragments:
        w1, w2 = (meta(e, o // 16, i // 32, UNIT, dtype=torch.uint8) for o, i in ((inter, d), (d, inter)))
    else:
        w1, w2 = (meta(e, o, i // 2, dtype=torch.uint8) for o, i in ((inter, d), (d, inter)))
    s1, s2 = (meta(e, o, i // 32, dtype=torch.bfloat16) for o, i in ((inter, d), (d, inter)))
    config = {"up": dict(tiles, split_k=split_k), "down": dict(tiles, split_k=split_k)}
    calls = []
    with use_launcher(calls.append):
        moe_experts(meta(tokens, d), meta(tokens, topk), meta(tokens, topk, dtype=torch.int64), w1, w2, w1, s1, s2, s1,
                    limit=10.0, config=config)
    return [c for c in calls if c.name == "moe_gemm_kernel"]


def sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def wgmma_loop(text: str) -> list[str]:
    """The instructions (predicates dropped) of the innermost backward branch's body that holds wgmma instructions."""
    body = []
    at = {}
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            at[int(m.group(1), 16)] = len(body)
            body.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(2)))
    loops = []
    for i, ins in enumerate(body):
        m = re.match(r"BRA\s+(0x[0-9a-f]+)", ins)
        if m and int(m.group(1), 16) in at and at[int(m.group(1), 16)] <= i:
            loop = body[at[int(m.group(1), 16)]:i + 1]
            if any(x.startswith("HGMMA") for x in loop):
                loops.append(loop)
    if not loops:
        raise ValueError("no loop with wgmma instructions in this cubin")
    return min(loops, key=len)


_NO_DESTINATION = ("ST", "RED", "BAR", "BRA", "HGMMA", "WARPGROUP", "LDGSTS", "DEPBAR", "LDGDEPBAR", "NOP", "EXIT",
                   "WARPSYNC", "MEMBAR", "FENCE", "ARRIVES", "SYNCS")


def _written(ins: str) -> set[int]:
    """The R registers an instruction writes: its first operand, over the width of the result."""
    op, _, rest = ins.partition(" ")
    m = re.match(r"R(\d+)\b", rest.strip())
    if op.startswith(_NO_DESTINATION) or not m:
        return set()
    width = 4 if ".128" in op else 2 if (".64" in op or op.startswith(("IMAD.WIDE", "CS2R", "DADD", "DMUL"))) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def operand_hazards(text: str) -> list[str]:
    """Instructions that overwrite the register operand of a wgmma still in flight: the A registers (4 a 16-input
    step) of the HGMMAs after the loop's last WARPGROUP.DEPBAR, written between the back edge and the next
    iteration's first WARPGROUP.DEPBAR, which is where they are known to have been read."""
    loop = wgmma_loop(text)
    waits = [i for i, x in enumerate(loop) if x.startswith("WARPGROUP.DEPBAR")]
    last = max(waits, default=-1)
    live = set()
    for x in loop[last + 1:]:
        if x.startswith("HGMMA"):
            a = re.match(r"R(\d+)", x.split(",")[1].strip())
            if a:  # A from registers (RS); a descriptor means shared memory
                live |= set(range(int(a.group(1)), int(a.group(1)) + 4))
    if not live:
        return []
    tail = max(i for i, x in enumerate(loop) if x.startswith("HGMMA") and i > last)
    window = loop[tail + 1:] + loop[:min(waits, default=len(loop))]
    return [x for x in window if _written(x) & live]


def loop_mix(text: str) -> collections.Counter:
    """Opcodes (loads with their width) of the innermost backward branch's body that holds wgmma instructions."""
    loop = wgmma_loop(text)
    return collections.Counter(x.split()[0] if x.startswith(("LDS", "LDG", "STS")) else x.split()[0].split(".")[0]
                               for x in loop)


def cubins_sass(tokens: int, tiles: dict) -> dict[str, dict[str, str]]:
    """{"GEMM 1" | "GEMM 2": {"raw" | "fragments": the kernel's SASS}}."""
    out: dict[str, dict[str, str]] = {"GEMM 1": {}, "GEMM 2": {}}
    for layout, fragments in (("raw", False), ("fragments", True)):
        for call in gemm_launches(tokens, tiles, fragments):
            gemm = "GEMM 1" if call.constexprs["GATED"] else "GEMM 2"
            out[gemm][layout] = sass(compile_launch(call, "sm90").cubin)
    return out


def mixes(texts: dict[str, dict[str, str]]) -> dict[str, dict[str, collections.Counter]]:
    """{"GEMM 1" | "GEMM 2": {"raw" | "fragments": the loop's opcodes}}."""
    return {gemm: {layout: loop_mix(t) for layout, t in by_layout.items()} for gemm, by_layout in texts.items()}


def table(found: dict[str, dict[str, collections.Counter]]) -> str:
    lines = []
    for gemm, by_layout in found.items():
        ops = sorted(set().union(*by_layout.values()), key=lambda o: -max(c[o] for c in by_layout.values()))
        lines.append(f"{gemm}: " + "  ".join(f"{layout} {sum(c.values())}" for layout, c in by_layout.items()))
        lines += [f"  {op:24s}" + "".join(f"{c[op]:>8d}" for c in by_layout.values()) for op in ops]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--config", type=json.loads, default=DECODE, help="one GEMM's tiles (both GEMMs take them)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    texts = cubins_sass(args.tokens, args.config)
    found = mixes(texts)
    hazards = {g: {k: operand_hazards(t) for k, t in v.items()} for g, v in texts.items()}
    print(f"per thread per loop iteration, tiles {args.config}; columns: raw, fragments")
    print(table(found))
    for gemm, by_layout in hazards.items():
        print(f"{gemm}: writes to the registers of wgmma operands in flight: "
              + ", ".join(f"{k} {len(v)}" for k, v in by_layout.items()))
    if args.json:
        args.json.write_text(json.dumps({g: {k: dict(c) for k, c in v.items()} for g, v in found.items()}
                                        | {"hazards": hazards}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
