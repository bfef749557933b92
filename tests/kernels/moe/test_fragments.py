"""fp4 expert codes in fragment order (kernels/moe/fragments.py): the format and its inverse, every word's decoding
against the e2m1 table, the grouped GEMMs over them against the same GEMMs over raw codes (bitwise: the same products
in the same order, under wgmma and mma.sync tiles) and against `dsl.ops.moe.moe_experts`, batch invariance, the
executor's format, and the compiled code (bench/moe_sass.py): the decode loop runs fewer instructions."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsl.ops.moe import moe_experts as ref_moe_experts
from kernels.lang import tl, triton
from kernels.moe.experts import default_config, moe_experts, prescaled
from kernels.moe.fragments import (
    UNIT,
    _bytes,
    _decode_plain,
    _unfragment,
    decode_word,
    fragment_codes,
    raw_codes,
)
from tests.kernels.cases import EXPERTS, HIDDEN, MOE_INTER, TOPK, gen, rel_l2
from tests.kernels.moe.test_experts import LIMIT, make_experts, routing

ROOT = Path(__file__).resolve().parents[3]
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def tiles(up: int = 1, down: int = 1, block_k: int = 64, block_n: int = 64) -> dict:
    """Tiles for both GEMMs: 64 rows are one wgmma warpgroup; 32 and 16 rows lower to mma.sync on the GPU, whose
    operand registers hold the words' codes in another order (the decoding must not care)."""
    gemm = dict(block_M=16, block_N=block_n, block_K=block_k, num_warps=4, num_stages=2)
    return dict(up=dict(gemm, split_k=up), down=dict(gemm, split_k=down))


def bf16_value(bits: int) -> float:
    """A bf16 bit pattern's value, exact (subnormals included)."""
    return torch.tensor([bits]).to(torch.int16).view(torch.bfloat16).double().item()


@pytest.mark.parametrize("shape,chunk", [((1, 16, 16), 1 << 24), ((3, 48, 80), 3000), ((2, 2304, 64), 1 << 16)])
def test_fragment_codes_round_trip(shape, chunk) -> None:
    """Any bytes, chunked or not (3000 bytes: one expert a chunk), come back from `raw_codes`."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(sum(shape)))
    fragments = fragment_codes(codes, chunk_bytes=chunk)
    e, n, kp = shape
    assert fragments.shape == (e, n // 16, kp // 16, UNIT) and fragments.dtype == torch.uint8
    assert torch.equal(raw_codes(fragments), codes)
    assert not torch.equal(fragments.reshape(codes.shape), codes)


@pytest.mark.parametrize("shape", [(2, 24, 16), (2, 16, 24), (16, 32)])
def test_fragment_codes_rejects_shapes_off_the_groups(shape) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        fragment_codes(torch.zeros(shape, dtype=torch.uint8))


def test_every_word_decodes_to_its_rows_and_columns() -> None:
    """Each 4-byte word of lane 4g + c, group r, unit u, half q decodes (as the kernels do) to the low and high
    nibbles of columns 16u + 8q + 2c + (0, 1) of rows 16r + g and 16r + g + 8, as e2m1 * 2^-126."""
    codes = torch.randint(0, 256, (2, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    words = fragment_codes(codes).reshape(-1, 4).view(torch.int32).reshape(2, 2, 2, 8, 4, 2)  # [e, r, u, g, c, q]
    for index in range(words.numel()):
        e, r, u, g, c, q = (int(i) for i in torch.unravel_index(torch.tensor(index), words.shape))
        pairs = decode_word(int(words[e, r, u, g, c, q]) & 0xFFFFFFFF)
        got = [bf16_value(p >> s & 0xFFFF) * 2.0**126 for p in pairs for s in (0, 16)]
        col = 16 * u + 8 * q + 2 * c
        rows = (16 * r + g, 16 * r + g + 8)
        byte = [int(codes[e, row, col + p]) for row in rows for p in (0, 1)]
        want = [E2M1[b & 15].item() for b in byte] + [E2M1[b >> 4].item() for b in byte]
        assert got == want and [math.copysign(1, v) for v in got] == [math.copysign(1, v) for v in want]


@triton.jit
def _decode_kernel(w_ptr, lo_ptr, hi_ptr, block_N: tl.constexpr, block_K: tl.constexpr):
    R: tl.constexpr = block_N // 16
    C: tl.constexpr = block_K // 32 * 256
    r = tl.arange(0, R)
    c = tl.arange(0, C // 4)
    l0, l1, l2, l3, h0, h1, h2, h3 = _decode_plain(tl.load(w_ptr + r[:, None] * (C // 4) + c[None, :]))
    lo, hi = _bytes(l0, l1, l2, l3, R, C), _bytes(h0, h1, h2, h3, R, C)
    n = tl.arange(0, block_N)[:, None] * (block_K // 2) + tl.arange(0, block_K // 2)[None, :]
    tl.store(lo_ptr + n, _unfragment(lo, block_N, block_K))
    tl.store(hi_ptr + n, _unfragment(hi, block_N, block_K))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path (the GPU runs the asm)")
def test_a_tile_decodes_in_the_interpreter_to_its_codes() -> None:
    """The interpreter's decoding of a [32, 128-input] tile, put back in row and column order: the e2m1 values."""
    codes = torch.randint(0, 256, (1, 32, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    lo, hi = torch.empty(32, 64), torch.empty(32, 64)
    _decode_kernel[(1,)](fragment_codes(codes).view(torch.int32), lo, hi, 32, 128)
    assert torch.equal(lo, E2M1[(codes[0] & 15).long()] * 2.0**-126)
    assert torch.equal(hi, E2M1[(codes[0] >> 4).long()] * 2.0**-126)
    assert torch.equal(torch.signbit(lo), torch.signbit(E2M1[(codes[0] & 15).long()]))


def both_layouts(t: int, e: int, inter: int, d: int, config: dict | None, device: str, scales: str = "prescaled",
                 dot_fp32: bool = False, k: int = TOPK, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """The experts' output on raw codes and on the same codes in fragment order, and the inputs (fp32 scales)."""
    ws, ss = make_experts(e, inter, d, "fp4", device)
    given = [prescaled(s) for s in ss] if scales == "prescaled" else ss
    weights, experts = routing(t, e, min(k, e), device, seed=seed + t)
    x = gen(t, d, device=device, seed=seed + t)
    raw = moe_experts(x, weights, experts, *ws, *given, limit=LIMIT, config=config, dot_fp32=dot_fp32)
    frag = moe_experts(x, weights, experts, *map(fragment_codes, ws), *given, limit=LIMIT, config=config,
                       dot_fp32=dot_fp32)
    return raw, frag, (x, weights, experts, ws, ss)


# (t, e, inter, d, config, scales, dot_fp32): 0 and 1 token, odd counts, 19 tokens past a block of 16 slots; 96 / 64
# leaves a short last split, 3 splits of 96 an empty one; 64-row tiles over 96 or 32 outputs leave part of a tile;
# 32- and 16-row tiles (mma.sync on the GPU)
BITWISE = [(5, 8, 64, 96, tiles(block_n=32), "prescaled", False),
           (9, 8, 96, 64, tiles(2, 1, 32, 16), "prescaled", False),
           (0, 8, 64, 96, tiles(), "prescaled", False), (1, 8, 64, 96, tiles(), "prescaled", False),
           (5, 8, 96, 64, tiles(), "fp32", False), (19, 4, 64, 96, tiles(2, 3), "prescaled", False),
           (1, 8, 64, 96, tiles(3, 1), "fp32", False), (7, 6, 64, 96, tiles(2, 2), "prescaled", True),
           (3, 8, 32, 64, tiles(block_k=32), "prescaled", False)]


@pytest.mark.usefixtures("row_independent_dot")  # the same rows in other blocks: the kernel's order, not the BLAS's
@pytest.mark.parametrize("t,e,inter,d,config,scales,dot_fp32", BITWISE)
def test_fragments_give_the_bits_of_raw_codes(t, e, inter, d, config, scales, dot_fp32, device) -> None:
    raw, frag, _ = both_layouts(t, e, inter, d, config, device, scales, dot_fp32)
    assert frag.shape == (t, d)
    assert torch.equal(frag, raw)
    assert t == 0 or (torch.isfinite(raw).all() and raw.abs().max() > 0)


@pytest.mark.parametrize("t,inter,d,config", [(1, 64, 96, tiles()), (7, 96, 64, tiles(2, 1)), (19, 64, 96, None)])
def test_fragments_match_the_reference(t, inter, d, config, device) -> None:
    """Against the op's reference on bf16-rounded x (the kernel's operands; the activation between the GEMMs is
    bf16 in the kernel, fp32 in the reference: the rest of the difference)."""
    _, frag, (x, weights, experts, ws, ss) = both_layouts(t, 8, inter, d, config, device, seed=11)
    want = ref_moe_experts(x.bfloat16().float(), weights, experts, *ws, *ss, limit=LIMIT)
    assert rel_l2(frag, want) < 5e-3


@pytest.mark.usefixtures("row_independent_dot")
def test_a_token_is_bitwise_the_same_alone_and_in_a_batch(device) -> None:
    """Under one split config a token's pairs land in other blocks and slots as the batch changes: the same bits."""
    e, inter, d, k = 8, 64, 96, 3
    ws, ss = make_experts(e, inter, d, "fp4", device)
    ws, ss = [fragment_codes(w) for w in ws], [prescaled(s) for s in ss]
    weights, experts = routing(1, e, k, device, seed=5)
    x = gen(1, d, device=device, seed=6)
    alone = moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=tiles(2, 2))
    for rows, at in [(6, 4), (21, 0), (33, 32)]:
        w_all, e_all = routing(rows, e, k, device, seed=rows)
        w_all[at], e_all[at] = weights[0], experts[0]
        x_all = gen(rows, d, device=device, seed=rows + 1)
        x_all[at] = x[0]
        assert torch.equal(moe_experts(x_all, w_all, e_all, *ws, *ss, limit=LIMIT, config=tiles(2, 2))[at], alone[0])


def test_fragments_need_tiles_of_whole_row_groups() -> None:
    ws, ss = make_experts(4, 64, 96, "fp4", "cpu")
    gemm = dict(block_M=16, block_N=24, block_K=64, num_warps=4, num_stages=2, split_k=1)
    weights, experts = routing(2, 4, 2, "cpu")
    with pytest.raises(ValueError, match="multiple of 16"):
        moe_experts(gen(2, 96), weights, experts, *map(fragment_codes, ws), *ss, limit=LIMIT,
                    config={"up": gemm, "down": gemm})


def _small_slice(moe_kernels: bool):
    """The small full-width slice (fp4 experts) planned for sm90 with its MoE nodes on the kernel (or none)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_slice

    from deepinfer.models import DeepseekV41Flash
    from dsl.passes import run_passes
    from graphs.passes import make_plan

    config = bench_slice.slice_config(small=True)
    model = DeepseekV41Flash(config, bench_slice.slice_weights(config, "cpu"))
    graph = run_passes(model.graph())
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,))
    for node in plan.nodes:
        if node.op != "moe_experts" or not moe_kernels:
            node.template = None
    return graph, plan, model.params()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the executor on the CPU, kernels under the interpreter")
def test_the_executor_keeps_only_the_fragments_and_gives_the_raw_kernels_bits() -> None:
    """The plan gives the MoE kernel fragments: the executor holds those alone for the expert codes (undone, the
    checkpoint's), and a step gives the bits of the same plan reading raw codes; an executor that would read the
    dropped raw codes on the same weights (a reference MoE node) is refused."""
    from dsl.context import ForwardContext, SequenceState
    from graphs.executor import Executor

    graph, plan, params = _small_slice(True)
    moe = [n for n in plan.kernel_nodes() if n.op == "moe_experts"]
    assert moe and all(n.formats[3] == n.formats[4] == n.formats[5] == "fragments" for n in moe)
    executor = Executor(graph, plan, params, "cpu")
    codes = [graph.nodes[n.index].inputs[i].name for n in moe for i in (3, 4, 5)]
    for name in codes:
        assert executor.params[name].dim() == 4 and torch.equal(raw_codes(executor.params[name]), params[name])
    _, raw_plan, _ = _small_slice(True)
    for node in raw_plan.kernel_nodes():
        node.formats = {**node.formats, 3: "raw", 4: "raw", 5: "raw"}
    raw = Executor(graph, raw_plan, params, "cpu")
    assert all(raw.params[name] is params[name] for name in codes)
    ids = torch.tensor([3, 17, 5, 9, 2])
    logits = [e.run({"input_ids": ids}, ForwardContext([SequenceState(), SequenceState()], [3, 2]))["logits"]
              for e in (executor, raw)]
    assert torch.equal(logits[0], logits[1]) and torch.isfinite(logits[0]).all()
    _, reference, _ = _small_slice(False)
    with pytest.raises(ValueError, match="read raw"):
        Executor(graph, reference, executor.params, "cpu", formatted=executor.formatted)


def _loop_mix(tiles: dict | None, tokens: int, out: Path) -> dict:
    """bench/moe_sass.py's instruction mix of both GEMMs' loops (run without the interpreter: it compiles none)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--tokens", str(tokens), "--json", str(out)] + ([] if tiles is None else ["--config", json.dumps(tiles)])
    subprocess.run([sys.executable, "bench/moe_sass.py", *args], cwd=ROOT, env=env, check=True, capture_output=True,
                   timeout=600)
    return json.loads(out.read_text())


def test_the_decode_loop_reads_whole_words_and_runs_fewer_instructions(tmp_path) -> None:
    """On cubins built here for sm_90a (no GPU needed): in both GEMMs' loops on fragments, no byte shuffles (PRMT) at
    the decode tiles and at the heuristic's prefill tiles: the words decode straight into the operand's registers; at
    the decode tiles no 2-byte loads either, and GEMM 1 at most 75% of the raw codes' instructions. In every loop, on
    either layout, no write to the registers of a wgmma operand still in flight (stages.py's `settled`)."""
    prefill = {k: v for k, v in default_config(8192)["up"].items() if k != "split_k"}
    mixes = {tiles is None: _loop_mix(tiles, tokens, tmp_path / f"{tokens}.json")
             for tiles, tokens in ((None, 64), (prefill, 8192))}
    for decode, mix in mixes.items():
        for gemm in ("GEMM 1", "GEMM 2"):
            frag, raw = mix[gemm]["fragments"], mix[gemm]["raw"]
            assert frag.get("PRMT", 0) == 0 and raw["PRMT"] > 0 and frag["HGMMA"] == raw["HGMMA"]
            assert sum(frag.values()) < sum(raw.values())
            assert not decode or frag.get("LDS.U16", 0) == 0 < raw["LDS.U16"]
    decode = mixes[True]["GEMM 1"]
    assert sum(decode["fragments"].values()) <= 0.75 * sum(decode["raw"].values())
    assert all(not hazards for mix in mixes.values() for gemm in ("GEMM 1", "GEMM 2")
               for hazards in mix["hazards"][gemm].values())


def _sass(*body: str) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;" for i, ins in enumerate(body))


def test_the_sass_check_finds_a_write_to_an_operand_in_flight() -> None:
    """bench/moe_sass.py's `operand_hazards` on hand-written loops: the A registers (R56..R59) of a wgmma issued after
    the loop's last wait are written at the top of the next iteration (a hazard), or after its wait, or the wgmma
    is waited for before the back edge (none); a shared-memory operand (a descriptor) holds no registers."""
    spec = importlib.util.spec_from_file_location("moe_sass", ROOT / "bench" / "moe_sass.py")
    sass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sass)
    head = ["DEPBAR.LE SB0, 0x3"]
    issue = ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR8], R24, gsb0"]
    wait, back = ["WARPGROUP.DEPBAR.LE gsb0, 0x0"], ["@!P1 BRA 0x0"]
    write = ["LDS.64 R58, [R10+0x6000]"]
    assert sass.operand_hazards(_sass(*head, *write, *wait, *issue, *back)) == write
    assert sass.operand_hazards(_sass(*head, *wait, *write, *issue, *back)) == []
    assert sass.operand_hazards(_sass(*head, *write, *wait, *issue, *wait, *back)) == []
    smem = ["WARPGROUP.ARRIVE", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0"]
    assert sass.operand_hazards(_sass(*head, *write, *wait, *smem, *back)) == []


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 16, 64, 256, 600])
@pytest.mark.parametrize("config", ["default", "unsplit", "split", "prefill", "narrow"])
def test_v41_shapes_fragments_give_the_bits_of_raw_codes(t, config) -> None:
    """On the GPU (the asm decoding) at V4.1's shapes, under wgmma tiles and mma.sync ones, K whole or split: the
    bits of the raw codes' kernel. 256 tokens run the 512-token bucket's default tiles."""
    chosen = {"default": None, "unsplit": tiles(1, 1, 128, 64), "split": tiles(4, 2, 128, 64),
              "prefill": default_config(8192), "narrow": tiles(1, 1, 128, 32)}[config]
    raw, frag, _ = both_layouts(t, EXPERTS, MOE_INTER, HIDDEN, chosen, "cuda")
    assert torch.equal(frag, raw) and raw.abs().max() > 0
