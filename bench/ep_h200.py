"""On one GPU: the distributed path at world size 1 against the plain path, and Engram rows fetched from host memory.

    python bench/ep_h200.py                       # both parts; JSON to $OUT (or /tmp) as ep_h200.json
    python bench/ep_h200.py --part ranks          # RankLLM (NCCL, world size 1) against LLM: bitwise, time a call
    python bench/ep_h200.py --part engram --rows 256000000
    python bench/ep_h200.py --part gpus           # on a host of several GPUs: spawned NCCL ranks against one GPU
    python bench/ep_h200.py --part plan           # the sm90 plan: RankLLM (NCCL, world size 1) against LLM
    python bench/ep_h200.py --part gpus --target sm90   # spawned NCCL ranks of the sm90 plan against one GPU

ranks: the embedded checkpoint on the cpu target's runtime on the GPU (target cpu, device cuda), one NCCL rank; the
same batch through `LLM` and through `RankLLM`, outputs compared bitwise, calls timed alternately (median), with the
rounds of agreement a call makes and the time of one agreement (all_reduce) and of one MoE exchange (the two
all_to_all_single of a decode step's 64 x 6 pairs) at world size 1.

plan: the same on the sm90 plan (cubins, CUDA graphs; under expert parallelism the MoE nodes run eagerly between the
graphs' segments, through the exchange), in batch-invariant mode and out of it: bitwise in batch-invariant mode, calls
timed alternately (median), steps a call, and one MoE node (the model's first, its own weights) at decode batches of
1 and 64 tokens: the plain kernel against the exchange's path at world size 1 (CUDA events around 100 runs each). A
short table, then the JSON.

engram: one host table of `--rows` rows x 256 fp8 codes with fp32 scales per 32 (a real Engram layer's table is
about 384M rows, 110 GB with those scales), filled, so its pages are resident; per case (decode 64 tokens, prefill
8192), 24 random rows a token (3 n-gram sizes x 8 heads) fetched by `HostEngramRows` alone (its fetch time), then
again while the GPU is kept busy for the case's time (the layers before the first Engram layer: layer 0, from the
slice's per-layer times in bench/RESULTS.md). What the overlap did not hide is the GPU's idle time between that work
and the layer that reads the rows (two CUDA events around the host's wait): the host's own wait at the layer counts
too where the host runs ahead of the GPU (a prefill), though the GPU is busy meanwhile. The same rows gathered from a
device table for comparison, and the embedded model's tokens with host and device storage.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.default_model import default_checkpoint  # noqa: E402
from deepinfer.distributed import ranks  # noqa: E402
from deepinfer.distributed.rank_llm import RankLLM  # noqa: E402
from graphs.engram_storage import HostEngramRows  # noqa: E402

CASES = {"decode B=64": (64, 4.2), "prefill 8192": (8192, 30.7)}  # tokens, ms of layer 0 (RESULTS.md slice / 4)
COLS, DIM = 24, 256
DEVICE = "cuda"  # --device cpu runs the same code on the cpu (gloo): a check of the script, not of its figures


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _event() -> torch.cuda.Event | None:
    """A timing event recorded on the current stream now (None on the cpu)."""
    if DEVICE != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _join() -> None:
    ranks.join_alone(DEVICE)


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def part_ranks(repeats: int) -> dict:
    _join()
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + 7 * i))} for i in range(32)]
    params = [SamplingParams(max_tokens=32, temperature=0.8 if i % 2 else 0, seed=i, ignore_eos=True)
              for i in range(32)]
    plain = LLM(default_checkpoint(), device=DEVICE, max_num_seqs=64)
    rank = RankLLM(default_checkpoint(), device=DEVICE, max_num_seqs=64)
    want, got = plain.generate(prompts, params, use_tqdm=False), rank.generate(prompts, params, use_tqdm=False)
    bitwise = all(dataclasses.replace(g, metrics=None) == dataclasses.replace(w, metrics=None)
                  for g, w in zip(got, want, strict=True))
    runtime = rank.compiled.runtime
    rounds_before, steps_before = runtime.num_rounds, rank.engine.num_steps
    times = {"plain": [], "rank": []}
    for _ in range(repeats):  # alternating, so drift hits both
        times["plain"].append(_median_s(lambda: plain.generate(prompts, params, use_tqdm=False), 1))
        times["rank"].append(_median_s(lambda: rank.generate(prompts, params, use_tqdm=False), 1))
    plain_s, rank_s = statistics.median(times["plain"]), statistics.median(times["rank"])
    wants = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    agree_s = _median_s(lambda: [dist.all_reduce(wants) for _ in range(100)], 5) / 100
    pairs = torch.randn(64 * 6, 5120 + 2, device=DEVICE)  # a decode step's 64 tokens x top 6: x, weight, expert id
    back = torch.empty_like(pairs)

    def exchange() -> None:  # one MoE layer's two exchanges (counts first, as the op sends them)
        counts = torch.tensor([pairs.shape[0]], device=DEVICE)
        dist.all_to_all_single(torch.empty_like(counts), counts)
        dist.all_to_all_single(back, pairs, [pairs.shape[0]], [pairs.shape[0]])
        dist.all_to_all_single(back[:, :-2].contiguous(), pairs[:, :-2].contiguous())

    exchange_s = _median_s(lambda: [exchange() for _ in range(100)], 5) / 100
    ranks.leave()
    return {"bitwise": bitwise, "plain_s": plain_s, "rank_s": rank_s, "overhead": rank_s / plain_s - 1,
            "steps_per_call": (rank.engine.num_steps - steps_before) / repeats,
            "rounds_per_call": (runtime.num_rounds - rounds_before) / repeats,
            "agree_us": agree_s * 1e6, "moe_exchange_us": exchange_s * 1e6,
            "moe_layers_per_forward": sum(n.op == "moe_experts" for n in rank.compiled.graph.nodes)}


def _same(got: list, want: list) -> bool:
    return all(dataclasses.replace(g, metrics=None) == dataclasses.replace(w, metrics=None)
               for g, w in zip(got, want, strict=True))


def _moe_node_us(rank: RankLLM, tokens: int, invariant: bool) -> tuple[float, float]:
    """(plain kernel, exchange at world size 1) microseconds of the model's first MoE node over `tokens` tokens."""
    from kernels.moe.lowering import MOE_EXPERTS

    mine = rank.compiled.runtime.inner.executors()[0]
    index = next(i for i, n in enumerate(mine.graph.nodes) if n.op == "moe_experts")
    node, entry = mine.graph.nodes[index], mine.plan.nodes[index]
    st = entry.static
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(tokens, st.d, device=DEVICE, generator=g)
    picks = torch.stack([torch.randperm(st.e, device=DEVICE, generator=g)[:st.topk] for _ in range(tokens)])
    weights = torch.rand(tokens, st.topk, device=DEVICE, generator=g)
    args = [x, weights, picks] + [None if v is None else mine.params[v.name] for v in node.inputs[3:]]
    for pos, fmt in entry.formats.items():  # the weights as the kernel takes them (Executor._kernel)
        if node.inputs[pos] is not None:
            args[pos] = mine.param(node.inputs[pos].name, fmt)
    chosen = entry.at(tokens, mine.plan.buckets, invariant)
    call = entry.call(chosen, node.attrs, mine.plan.dot_fp32, args)
    buckets = mine.plan.buckets

    def config_for(pairs: int) -> dict:  # as the executor picks it (graphs/executor.py)
        return entry.at(-(-pairs // st.topk), buckets, invariant).config

    def plain_run() -> None:
        MOE_EXPERTS.run(call)

    def split_run() -> None:
        MOE_EXPERTS.run_parallel(call, mine.parallel_experts, invariant, config_for)

    with rank.compiled.runtime.inner.launches():
        out = []
        for fn in (plain_run, split_run):
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(100):
                fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) * 10)  # ms per 100 -> us each
    return out[0], out[1]


def part_plan(repeats: int, target: str) -> dict:
    """The plan runtime: RankLLM (one NCCL rank) against LLM on `target`, per mode."""
    _join()
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + 7 * i))} for i in range(32)]
    params = [SamplingParams(max_tokens=32, temperature=0.8 if i % 2 else 0, seed=i, ignore_eos=True)
              for i in range(32)]
    out: dict = {"target": target}
    for invariant in (True, False):
        plain = LLM(default_checkpoint(), target=target, max_num_seqs=64, batch_invariant=invariant)
        rank = RankLLM(default_checkpoint(), target=target, max_num_seqs=64, batch_invariant=invariant)
        want, got = plain.generate(prompts, params, use_tqdm=False), rank.generate(prompts, params, use_tqdm=False)
        steps_before = rank.engine.num_steps
        times = {"plain": [], "rank": []}
        for _ in range(repeats):  # alternating, so drift hits both
            times["plain"].append(_median_s(lambda plain=plain: plain.generate(prompts, params, use_tqdm=False), 1))
            times["rank"].append(_median_s(lambda rank=rank: rank.generate(prompts, params, use_tqdm=False), 1))
        plain_s, rank_s = statistics.median(times["plain"]), statistics.median(times["rank"])
        moe = {t: _moe_node_us(rank, t, invariant) for t in (1, 64)}
        out["invariant" if invariant else "default"] = {
            "bitwise": _same(got, want), "plain_s": plain_s, "rank_s": rank_s, "ratio": rank_s / plain_s,
            "steps_per_call": (rank.engine.num_steps - steps_before) / repeats,
            "moe_layers_per_forward": sum(n.op == "moe_experts" for n in rank.compiled.graph.nodes),
            "moe_node_us": {str(t): {"plain": a, "exchange": b, "ratio": b / a} for t, (a, b) in moe.items()}}
        del plain, rank
    ranks.leave()
    print(f"{'mode':10} {'bitwise':>7} {'plain s':>8} {'rank s':>8} {'ratio':>6}   MoE node us (plain / exchange)")
    for mode in ("invariant", "default"):
        r = out[mode]
        nodes = "  ".join(f"T={t}: {m['plain']:.0f} / {m['exchange']:.0f}" for t, m in r["moe_node_us"].items())
        print(f"{mode:10} {str(r['bitwise']):>7} {r['plain_s']:8.3f} {r['rank_s']:8.3f} {r['ratio']:6.3f}   {nodes}")
    return out


def part_gpus(repeats: int, target: str) -> dict:
    """`LLM(..., expert_parallel_size=<GPUs>)` (NCCL ranks it spawns) against one GPU, bitwise: the cpu target's
    runtime on the GPUs (device cuda) or a GPU target's plan (batch-invariant mode)."""
    world = torch.cuda.device_count() if DEVICE == "cuda" else 2
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + 7 * i))} for i in range(32)]
    params = [SamplingParams(max_tokens=32, temperature=0.8 if i % 2 else 0, seed=i, ignore_eos=True)
              for i in range(32)]
    common = {"device": DEVICE} if target == "cpu" else {"target": target, "batch_invariant": True}
    want = LLM(default_checkpoint(), max_num_seqs=64, **common).generate(prompts, params, use_tqdm=False)
    spawned = LLM(default_checkpoint(), max_num_seqs=64, expert_parallel_size=world, **common)
    got = spawned.generate(prompts, params, use_tqdm=False)
    seconds = _median_s(lambda: spawned.generate(prompts, params, use_tqdm=False), repeats)
    spawned.close()
    return {"world_size": world, "target": target, "seconds_per_call": seconds, "bitwise": _same(got, want)}


def _busy(ms: float) -> None:
    """Keep the GPU busy for about `ms` (bf16 4096^3 matmuls, calibrated once)."""
    a = torch.randn(4096, 4096, device=DEVICE, dtype=torch.bfloat16)
    one = _median_s(lambda: a @ a, 5) * 1e3
    for _ in range(max(1, round(ms / one))):
        a @ a


def part_engram(rows: int, repeats: int) -> dict:
    start = time.perf_counter()
    table = torch.empty(rows, DIM, dtype=torch.uint8).fill_(0x38).view(torch.float8_e4m3fn)
    scale = torch.ones(rows, DIM // 32)
    out: dict = {"rows": rows, "table_gb": (table.nbytes + scale.nbytes) / 1e9,
                 "fill_s": time.perf_counter() - start}
    fetcher = HostEngramRows([({}, table, scale)], torch.device(DEVICE))
    device_rows = min(rows, 16 << 20)
    device_table, device_scale = table[:device_rows].to(DEVICE), scale[:device_rows].to(DEVICE)
    for name, (tokens, before_ms) in CASES.items():
        ids = torch.randint(0, rows, (tokens, COLS))
        alone, waits, fetches, stalls = [], [], [], []
        for _ in range(repeats):
            s0 = fetcher.stats.fetch_s
            fetcher.submit(ids, table, scale)
            fetcher.take(tokens)
            alone.append(fetcher.stats.fetch_s - s0)
            s0, w0 = fetcher.stats.fetch_s, fetcher.stats.wait_s
            fetcher.submit(ids, table, scale)
            _busy(before_ms)
            before = _event()
            got = fetcher.take(tokens)
            after = _event()
            got.sum()  # the layer that reads them
            _sync()
            fetches.append(fetcher.stats.fetch_s - s0)
            waits.append(fetcher.stats.wait_s - w0)
            # the GPU idled from the end of its earlier work until the host, its wait over, queued the layer
            stalls.append(before.elapsed_time(after) / 1e3 if before is not None else waits[-1])
        local = (ids % device_rows).to(DEVICE).reshape(-1)
        gather_s = _median_s(lambda local=local: (device_table.index_select(0, local),
                                                  device_scale.index_select(0, local)), repeats)
        fetch, wait, stall = statistics.median(fetches), statistics.median(waits), statistics.median(stalls)
        out[name] = {"tokens": tokens, "mb": tokens * COLS * (DIM + DIM // 32 * 4) / 1e6,
                     "fetch_alone_ms": statistics.median(alone) * 1e3, "fetch_overlapped_ms": fetch * 1e3,
                     "before_ms": before_ms, "host_wait_ms": wait * 1e3, "gpu_idle_ms": stall * 1e3,
                     "hidden": 1 - stall / max(fetch, 1e-12), "device_gather_ms": gather_s * 1e3}
    prompts = ["def fib(n):", {"prompt_token_ids": list(range(100, 400))}]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=1, logprobs=2)
    host = LLM(default_checkpoint(), device=DEVICE, engram_storage="host").generate(prompts, params, use_tqdm=False)
    dev = LLM(default_checkpoint(), device=DEVICE, engram_storage="device").generate(prompts, params, use_tqdm=False)
    out["model_bitwise"] = all(h.outputs == d.outputs for h, d in zip(host, dev, strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("ranks", "engram", "both", "gpus", "plan"), default="both",
                        help="gpus: spawned NCCL ranks, one per GPU, against one GPU (a host of several GPUs); "
                             "plan: the GPU target's plan at world size 1 against the plain plan")
    parser.add_argument("--target", default="cpu", help="gpus: the target the ranks run (plan: sm90 if cpu)")
    parser.add_argument("--rows", type=int, default=256_000_000, help="rows of the host table (256 B each + scales)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    results = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}
    if args.part in ("ranks", "both"):
        results["ranks"] = part_ranks(args.repeats)
        print(json.dumps(results["ranks"], indent=1), flush=True)
    if args.part == "plan":
        results["plan"] = part_plan(args.repeats, "sm90" if args.target == "cpu" else args.target)
        print(json.dumps(results["plan"], indent=1), flush=True)
    if args.part == "gpus":
        results["gpus"] = part_gpus(args.repeats, args.target)
        print(json.dumps(results["gpus"], indent=1), flush=True)
    if args.part in ("engram", "both"):
        results["engram"] = part_engram(args.rows, args.repeats)
        print(json.dumps(results["engram"], indent=1), flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"), "ep_h200.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
