"""What the kernel benchmarks share (bench/bench_kernels.py, bench/bench_prefill.py, bench/bench_replaced.py): the rows
they record, the ceilings a row is measured against, the V4.1-Flash linear shapes, and `cycler`."""

from __future__ import annotations

import json

HBM_TBS, BF16_TFLOPS, FP8_TFLOPS = 4.28, 754.0, 1265.0  # DESIGN.md's measured ceilings (fp8: low end)
ROWS: list[dict] = []


def record(kernel: str, shape: str, us: float, nbytes: float | None = None, flops: float | None = None,
           base: str | None = None, base_us: float | None = None, ceiling_tflops: float = BF16_TFLOPS,
           eager_us: float | None = None) -> None:
    """`eager_us`: torch eager's time too, where the baseline is another kernel."""
    row = {"kernel": kernel, "shape": shape, "us": round(us, 2)}
    if nbytes:
        row["TB/s"] = round(nbytes / us / 1e6, 3)
        row["%HBM"] = round(100 * row["TB/s"] / HBM_TBS, 1)
    if flops:
        row["TFLOP/s"] = round(flops / us / 1e6, 1)
        row["%peak"] = round(100 * row["TFLOP/s"] / ceiling_tflops, 1)
    if base:
        row["baseline"], row["base_us"] = base, round(base_us, 2)
        row["speedup"] = round(base_us / us, 2)
    if eager_us:
        row["eager_us"], row["x eager"] = round(eager_us, 2), round(eager_us / us, 2)
    ROWS.append(row)
    print(json.dumps(row), flush=True)


LINEARS = [("wq_a", 1280, 5120, 1), ("wq_b", 32768, 1280, 1), ("wkv", 512, 5120, 1), ("wo_a", 1024, 4096, 8),
           ("wo_b", 5120, 8192, 1)]


__all__ = ["BF16_TFLOPS", "FP8_TFLOPS", "HBM_TBS", "LINEARS", "ROWS", "record"]


def cycler(items: list):
    """A function returning the next of `items` at each call, round and round: inputs rotated past the L2."""
    state = {"i": 0}

    def nxt():
        state["i"] += 1
        return items[state["i"] % len(items)]
    return nxt
