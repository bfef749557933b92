"""One token through V4.1-Flash's decode linears: the one-row kernel (kernels/linear/gemv.py, what a batch-1 decode
step runs) against the tensor-core decode GEMM with the plan's config for the smallest bucket (`gemv` False: what
batch-invariant steps run), side by side in one process on one GPU. First the fp8 projections, then the plain ones:
the compressors' and the indexer's bf16 projections, the router's fp32 one (fp32 products on the tensor-core
kernel, as `moe_gate` asks) and the bf16 head.

Each shape is checked first (both within 2e-5 of the fp64 reference of their own operands: fp32 activations for the
one-row kernel, bf16 ones for the tensor cores, fp32 ones for fp32 products), then timed from CUDA-graph replays
(`autotune.tune.time_us`, medians), weights rotated past the L2. Bytes are the weights (fp8 codes and fp32 block
scales); TB/s against the H200's 4.28.
Last, the shared expert's activation h for one token: gate, up and the clamped SwiGLU on the tensor cores (three
launches), on two one-row launches and the activation kernel (three), and in one launch (`swiglu_one_row`, what a
batch-1 step runs), the last two checked bitwise equal first.

    python bench/bench_gemv.py [--out results.json]

Needs a CUDA GPU and Triton (it compiles its kernels there); no carried cubins.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_rows import HBM_TBS, cycler  # noqa: E402

from autotune.cache import TuningCache, cache_key, template_hash  # noqa: E402
from autotune.tune import time_us  # noqa: E402
from dsl.quant import dequantize_fp8_block, quantize_fp8_block  # noqa: E402
from graphs.plan import bucket_of  # noqa: E402
from kernels.linear.linear import default_config, gemv_config, linear  # noqa: E402
from kernels.linear.swiglu import swiglu, swiglu_one_row  # noqa: E402
from kernels.tuning import rotation  # noqa: E402

# (name, n, k, groups): the attention's projections, the shared expert's, the indexer's query
SHAPES = [("wq_a", 1280, 5120, 1), ("wq_b", 32768, 1280, 1), ("wkv", 512, 5120, 1), ("wo_a", 1024, 4096, 8),
          ("wo_b", 5120, 8192, 1), ("shared w1/w3", 2304, 5120, 1), ("shared w2", 5120, 2304, 1),
          ("indexer wq_b", 4096, 1280, 1)]
# (name, n, k, weight dtype): the compressors' and the indexer's plain projections, the router's, the head
PLAIN = [("compressor", 512, 5120, torch.bfloat16), ("indexer w", 32, 5120, torch.bfloat16),
         ("router", 384, 5120, torch.float32), ("head", 129280, 5120, torch.bfloat16)]
TUNED = Path(__file__).resolve().parent.parent / "autotune" / "tuned" / "sm90.json"


def tensor_config(n: int, k: int, groups: int, fmt: str = "fp8", template: str = "linear") -> tuple[dict, str]:
    """The plan's config for one token: the H200's tuned one for the smallest bucket where there is one."""
    static = {"e": n, "d": k} if template == "moe_gate" else {"n": n, "k": k, "groups": groups, "fmt": fmt}
    key = cache_key(template, static, bucket_of(1), "sm90", "NVIDIA H200", template_hash(template))
    tuned = TuningCache(TUNED).get(key)
    if tuned:
        return tuned, "tuned"
    return default_config(1, n, k, groups, fp8=fmt == "fp8", w_bytes=4 if template == "moe_gate" else 2), "heuristic"


def reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, groups: int) -> torch.Tensor:
    n, k = q.shape[0] // groups, q.shape[1]
    w = dequantize_fp8_block(q, s).double()
    xs = x.double().view(groups, k)
    return torch.stack([xs[g] @ w[g * n:(g + 1) * n].T for g in range(groups)]).reshape(1, -1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the rows as JSON")
    args = p.parse_args()
    rows = []
    print(f"{torch.cuda.get_device_name()}: one token, fp8 weights; µs medians of CUDA-graph replays")
    print(f"{'shape':<14} {'n x k':>14} {'tensor µs':>10} {'one-row µs':>11} {'speedup':>8} {'TB/s':>6} {'% HBM':>6}"
          "  tensor config / one-row split")
    for name, n, k, groups in SHAPES:
        w = torch.randn(groups * n, k, device="cuda") * k**-0.5
        q, s = quantize_fp8_block(w)
        del w
        x = torch.randn(1, groups * k, device="cuda")
        config, source = tensor_config(n, k, groups)
        cores = dict(config, gemv=False)
        want = reference(x, q, s, groups)
        err_row = ((linear(x, q, s, groups=groups).double() - want).norm() / want.norm()).item()
        err_cores = ((linear(x, q, s, groups=groups, config=cores).double()
                      - reference(x.bfloat16().float(), q, s, groups)).norm() / want.norm()).item()
        if not (err_row < 2e-5 and err_cores < 2e-5):
            raise SystemExit(f"{name}: rel L2 {err_row:.1e} (one row), {err_cores:.1e} (tensor cores) over 2e-5")
        weights = cycler(rotation(q))
        tensor_us = time_us(lambda: linear(x, weights(), s, groups=groups, config=cores))
        row_us = time_us(lambda: linear(x, weights(), s, groups=groups, config=config))
        nbytes = q.numel() + s.numel() * 4
        tbs = nbytes / row_us / 1e6
        row = {"shape": name, "n": n, "k": k, "groups": groups, "bytes": nbytes, "tensor_us": tensor_us,
               "tensor_config": config, "tensor_source": source, "one_row_us": row_us,
               "one_row_split": gemv_config(n, k, groups)["split_k"], "speedup": tensor_us / row_us, "tbs": tbs}
        rows.append(row)
        print(f"{name:<14} {f'{groups}x{n}x{k}':>14} {tensor_us:>10.2f} {row_us:>11.2f} {tensor_us / row_us:>7.2f}x "
              f"{tbs:>6.2f} {100 * tbs / HBM_TBS:>5.1f}  {source} {config} / split {row['one_row_split']}",
              flush=True)
    tensor, one_row = sum(r["tensor_us"] for r in rows), sum(r["one_row_us"] for r in rows)
    print(f"all shapes once: tensor cores {tensor:.1f} µs, one-row kernel {one_row:.1f} µs ({tensor / one_row:.2f}x)")
    rows += [plain_row(*shape) for shape in PLAIN]
    rows.append(shared_activation())
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


def plain_row(name: str, n: int, k: int, dtype: torch.dtype) -> dict:
    """One plain projection for one token: the one-row kernel against the tensor cores (module docstring)."""
    w = (torch.randn(n, k, device="cuda") * k**-0.5).to(dtype)
    x = torch.randn(1, k, device="cuda")
    exact = dtype == torch.float32  # the router's: fp32 products on the tensor-core kernel too
    config, source = tensor_config(n, k, 1, "plain", "moe_gate" if name == "router" else "linear")
    cores = dict(config, gemv=False)
    want = x.double() @ w.double().T
    err_row = ((linear(x, w).double() - want).norm() / want.norm()).item()
    xc = x if exact else x.bfloat16().float()
    err_cores = ((linear(x, w, config=cores, dot_fp32=exact).double() - xc.double() @ w.double().T).norm()
                 / want.norm()).item()
    if not (err_row < 2e-5 and err_cores < 2e-5):
        raise SystemExit(f"{name}: rel L2 {err_row:.1e} (one row), {err_cores:.1e} (tensor cores) over 2e-5")
    weights = cycler(rotation(w))
    tensor_us = time_us(lambda: linear(x, weights(), config=cores, dot_fp32=exact))
    row_us = time_us(lambda: linear(x, weights()))
    nbytes = w.numel() * w.element_size()
    tbs = nbytes / row_us / 1e6
    split = gemv_config(n, k, w_bytes=w.element_size())["split_k"]
    print(f"{name:<14} {f'{n}x{k} {str(dtype)[6:]}':>14} {tensor_us:>10.2f} {row_us:>11.2f} "
          f"{tensor_us / row_us:>7.2f}x {tbs:>6.2f} {100 * tbs / HBM_TBS:>5.1f}  {source} {config} / split {split}",
          flush=True)
    return {"shape": name, "n": n, "k": k, "dtype": str(dtype), "bytes": nbytes, "tensor_us": tensor_us,
            "tensor_config": config, "tensor_source": source, "one_row_us": row_us, "one_row_split": split,
            "speedup": tensor_us / row_us, "tbs": tbs}


def shared_activation(n: int = 2304, k: int = 5120, limit: float = 10.0) -> dict:
    """The shared expert's h for one token three ways (module docstring), µs and TB/s over both weights."""
    pair = [quantize_fp8_block(torch.randn(n, k, device="cuda") * (4 * k**-0.5)) for _ in range(2)]
    x = torch.randn(1, k, device="cuda")
    (q1, s1), (q3, s3) = pair
    if not torch.equal(swiglu_one_row(x, q1, s1, q3, s3, limit=limit),
                       swiglu(linear(x, q1, s1), linear(x, q3, s3), limit=limit)):
        raise SystemExit("shared h: one launch is not bitwise the one-row projections and the activation kernel")
    cores, _ = tensor_config(n, k, 1)
    cores = dict(cores, gemv=False)
    w1, w3 = cycler(rotation(q1)), cycler(rotation(q3))
    us = {"tensor cores, 3 launches": time_us(lambda: swiglu(linear(x, w1(), s1, config=cores),
                                                             linear(x, w3(), s3, config=cores), limit=limit)),
          "one row, 3 launches": time_us(lambda: swiglu(linear(x, w1(), s1), linear(x, w3(), s3), limit=limit)),
          "one row, 1 launch": time_us(lambda: swiglu_one_row(x, w1(), s1, w3(), s3, limit=limit))}
    nbytes = 2 * (q1.numel() + s1.numel() * 4)
    for way, t in us.items():
        print(f"shared h {way:<25} {t:>8.2f} µs {nbytes / t / 1e6:>6.2f} TB/s")
    return {"shape": "shared h", "n": n, "k": k, "bytes": nbytes, "us": us}


if __name__ == "__main__":
    sys.exit(main())
