"""End to end on a full-width slice of V4.1-Flash: tokens/s of the sm90 target against the cpu target's torch code
run on the same GPU (eagerly, and under torch.compile), and against the memory roofline of each step.

The slice keeps every real width (hidden 5120, 64 heads x 512, q_lora 1280, o_groups 8 x 1024, 384 routed experts
top 6 of 2304 in fp4, hc_mult 4, vocab 129280, window 128, index_topk 512) and one layer of each kind: a window-only
layer; an encoder (ratio 2) that owns a compressor and an indexer, as layer 2 of the model; a decoder (ratio 1) that
owns them for the decoder half and picks candidate blocks, as layer 20; and a plain decoder reading both, as layers
21-23; plus embedding and head. Weights are random, made on the device in the checkpoint's storage formats (fp8
32x32 blocks for the attention projections, indexer query and shared expert; fp4 routed experts; the rest bf16/fp32).
Sequences keep their caches in one `PagedCache`, as the engine does (`--unpaged`: tensors of each sequence's own).

    python bench/bench_slice.py [--out slice.json] [--artifact DIR] [--paths sm90,eager,compile] [--budget 300]
                                [--context 16384]        # decode over 16384 cached tokens instead of 1024
    python bench/bench_slice.py --small          # every dimension shrunk: runs on a CPU in seconds (the sm90 plan's
                                                 # kernels then run under Triton's interpreter)
    python bench/bench_slice.py --build-artifact artifacts/slice-sm90   # the sm90 artifact, built without a GPU
    python bench/bench_slice.py --build-artifact artifacts/slice-sm90-fp8 --fp8-activations [--buckets 8192]
                                                                    # e4m3 activations (prefill buckets only: smaller)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available() and "--build-artifact" not in sys.argv:  # the plan's Triton kernels then run under
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the interpreter, which must be chosen before Triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from slice_caches import Caches  # noqa: E402
from slice_compile import compiled_kernels  # noqa: E402

import deepinfer  # noqa: E402
from deepinfer.config import DeepseekV41Config  # noqa: E402
from deepinfer.default_model import _init  # noqa: E402
from deepinfer.models import DeepseekV41Flash  # noqa: E402
from deepinfer.models.weights import expected_weights  # noqa: E402
from dsl.cache_format import EntryFormat  # noqa: E402
from dsl.context import ForwardContext, SequenceState  # noqa: E402
from dsl.interpret import interpret  # noqa: E402
from dsl.passes import run_passes  # noqa: E402
from dsl.quant import quantize_fp8_block  # noqa: E402

HBM_TBS, BF16_TFLOPS = 4.28, 754.0  # DESIGN.md's measured H200 ceilings
FP4_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of a uniformly random e2m1 code
ROWS: list[dict] = []
PREFILL_CHUNK = 4096  # tokens a context prefill step takes: longer contexts come in several, as the engine's would


def slice_config(small: bool = False) -> DeepseekV41Config:
    """The four-layer slice: ratios (0, 2, 1, 1), KV and index sources 1 and 2, candidates at 2."""
    yarn = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 65536}
    shrink = {} if not small else dict(  # multiples of 32 where the fp8 / fp4 formats need them
        vocab_size=512, hidden_size=128, num_attention_heads=2, head_dim=32, q_lora_rank=32, qk_rope_head_dim=16,
        o_groups=2, o_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        index_n_heads=4, index_head_dim=32, index_topk=8, sliding_window=8, candidate_topk_blocks=2)
    return DeepseekV41Config(num_hidden_layers=4, compress_ratios=(0, 2, 1, 1), kv_source_layer_ids=(1, 2),
                             index_source_layer_ids=(1, 2), candidate_source_layer_id=2, num_nextn_predict_layers=0,
                             rope_scaling=yarn, **shrink)


def slice_weights(config: DeepseekV41Config, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights in the checkpoint's storage formats, made on `device` ("meta": shapes and dtypes only).
    Routed experts come stacked ([E, I, D/2] fp4 codes, fp32 scales) with unit-scale outputs for unit inputs."""
    meta = device == "meta"
    gen = None if meta else torch.Generator(device).manual_seed(seed)
    out = {}
    with torch.device(device):
        for name, spec in sorted(expected_weights(config).items()):
            if spec.optional or ".ffn.experts." in name:
                continue
            if spec.quant == "fp8":
                w = torch.empty(spec.shape) if meta else torch.randn(spec.shape, generator=gen) * spec.shape[1] ** -0.5
                out[name], out[name.removesuffix("weight") + "scale"] = (
                    (w.to(torch.float8_e4m3fn), torch.empty(spec.scale_shape())) if meta else quantize_fp8_block(w))
            else:
                out[name] = torch.empty(spec.shape, dtype=spec.dtype) if meta else \
                    _init(name, spec.shape, spec.dtype, gen)  # the embedded default model's rules, on the device
        e, inter, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        for layer in range(config.num_hidden_layers):
            for w, (o, i) in {"w1": (inter, d), "w2": (d, inter), "w3": (inter, d)}.items():
                prefix = f"layers.{layer}.ffn.experts.{w}"
                scale = 2.0 ** round(math.log2(1 / (FP4_RMS * math.sqrt(i))))
                out[f"{prefix}.scale"] = torch.full((e, o, i // 32), scale)
                out[f"{prefix}.weight"] = torch.empty(e, o, i // 2, dtype=torch.uint8) if meta else \
                    torch.randint(0, 256, (e, o, i // 2), dtype=torch.uint8, generator=gen)
    return out


@dataclass(frozen=True)
class Case:
    kind: str  # "decode" | "prefill"
    batch: int  # sequences
    tokens: int  # new tokens per sequence
    context: int  # tokens each sequence has cached before the step

    @property
    def name(self) -> str:
        return f"decode B={self.batch} ctx={self.context}" if self.kind == "decode" else f"prefill {self.tokens}"

    @property
    def num_tokens(self) -> int:
        return self.batch * self.tokens


def cases(small: bool, context: int = 0) -> list[Case]:
    """The decode batches over `context` cached tokens (default 1024; 8 with `small`), then the prefills."""
    ctx, batches, prefills = (8, (1, 2), (8, 24)) if small else (1024, (1, 16, 64, 256), (1024, 8192))
    ctx = context or ctx
    return [Case("decode", b, 1, ctx) for b in batches] + [Case("prefill", 1, t, 0) for t in prefills]


# ---- the roofline: bytes of weights and KV a step must read, and its dense FLOPs ---------------------------------

def expected_experts(config: DeepseekV41Config, tokens: int) -> float:
    """Distinct routed experts `tokens` tokens touch in a layer when each picks k of E uniformly (random weights)."""
    e, k = config.n_routed_experts, config.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens)


def roofline(config: DeepseekV41Config, params: dict[str, torch.Tensor], case: Case) -> dict:
    """Memory roofline (weights once + KV once, over 4.28 TB/s) and compute bound (dense FLOPs at 754 TFLOP/s)."""
    c, n = config, case.num_tokens
    weight_bytes = flops = 0.0
    for name, t in params.items():
        nbytes = t.numel() * t.element_size()
        if ".ffn.experts." in name:  # stacked [E, ...]: only the routed-to experts are read
            weight_bytes += nbytes / c.n_routed_experts * expected_experts(c, n)
        elif name == "embed.weight":
            weight_bytes += nbytes / t.shape[0] * n
        else:
            weight_bytes += nbytes
            if t.dim() == 2 and name.endswith("weight") and "norm" not in name:  # a matrix every token multiplies
                flops += 2 * t.shape[0] * t.shape[1] * (case.batch if name == "head.weight" else n)
    per_expert = 3 * c.moe_intermediate_size * c.hidden_size
    flops += 2 * n * c.num_experts_per_tok * per_expert * c.num_hidden_layers
    window = EntryFormat("fp8", 32).entry_bytes(c.head_dim)
    entry = EntryFormat("fp4", 16, True).entry_bytes(c.head_dim)
    key = EntryFormat("fp4", 32).entry_bytes(c.index_head_dim)
    kv_bytes = 0.0
    for layer, ratio in enumerate(c.compress_ratios[: c.num_hidden_layers]):
        total, indexed = case.context + case.tokens, layer in c.index_source_layer_ids
        # compressed entries a token sees: the new token's in decode, on average half the chunk's in a prefill
        visible = (total if case.kind == "decode" else total // 2) // ratio if ratio else 0
        picks = min(c.index_topk, visible)
        if case.kind == "decode":  # each new token reads its window and picks; an index source scores every entry
            seen = min(total, c.sliding_window) * window + picks * entry + indexed * visible * key
        else:  # a prefill reads the caches it writes once
            seen = total * window + (total // ratio * (entry + indexed * key) if ratio else 0)
        kv_bytes += case.batch * seen
        flops += 4 * n * c.num_attention_heads * c.head_dim * (min(total, c.sliding_window) + picks)
        flops += 2 * n * visible * c.index_n_heads * c.index_head_dim * indexed
    mem_us = (weight_bytes + kv_bytes) / HBM_TBS / 1e6
    return {"weight_GB": weight_bytes / 1e9, "kv_GB": kv_bytes / 1e9, "mem_us": mem_us,
            "compute_us": flops / BF16_TFLOPS / 1e6, "roof_us": max(mem_us, flops / BF16_TFLOPS / 1e6)}


# ---- the three ways of running a step -------------------------------------------------------------------------------

def _inputs(batch: list[tuple[SequenceState, list[int]]], device: str):
    lengths = [len(t) for _, t in batch]
    ids = torch.tensor([t for _, tokens in batch for t in tokens], dtype=torch.long, device=device)
    rows = (torch.tensor(lengths).cumsum(0) - 1).to(device)  # logits of each chunk's last token, as the engine asks
    return ids, ForwardContext([s for s, _ in batch], lengths, device=device, logit_rows=rows)


def interpret_step(graph, params: dict, device: str, kernels: dict | None = None):
    """A step of the cpu target's code (the DSL interpreter and the ops' torch references) on `device`."""

    @torch.inference_mode()
    def step(batch):
        ids, ctx = _inputs(batch, device)
        logits = interpret(graph, {"input_ids": ids}, params, ctx, kernels)["logits"]
        ctx.commit()
        return logits
    return step


def sm90_step(model: DeepseekV41Flash, artifact: str | None, device: str, cuda_graphs: bool = True):
    """The sm90 target: the saved artifact (or a fresh compile) run by its CompiledModel, its static segments replayed
    as CUDA graphs or not; on a machine without a GPU, the same plan through the executor with its Triton kernels
    under the interpreter."""
    return sm90_runner(model, artifact, device, cuda_graphs)[0]


def host_relaid(model: DeepseekV41Flash, executors) -> None:
    """Move to the host the model's device weights that the executors hold only in another layout (the fp4 experts
    in fragment order): the slice's weights are made on the device, where the model's raw copy beside the executors'
    would double the experts' memory (an engine reads its checkpoint on the host, so it has one device copy). The
    paths run after sm90 copy them back."""
    params = model.params()
    kept = {id(t) for e in executors if e is not None for t in e.params.values() if isinstance(t, torch.Tensor)}
    for name, t in list(params.items()):
        if isinstance(t, torch.Tensor) and t.is_cuda and id(t) not in kept:
            host = t.cpu()
            for table in (params, model.weights):
                if table.get(name) is t:
                    table[name] = host
    torch.cuda.empty_cache()


def sm90_runner(model: DeepseekV41Flash, artifact: str | None, device: str, cuda_graphs: bool = True):
    """(`sm90_step`'s step, the executor of its main graph, for timers: bench/node_timing.py)."""
    if device == "cuda":
        try:
            compiled = deepinfer.load(artifact, model) if artifact else None
        except (OSError, ValueError) as e:  # absent, or made from another graph: compile here (slower)
            print(f"artifact {artifact} not used ({e}); compiling", flush=True)
            compiled = None
        compiled = compiled or deepinfer.compile(model, target="sm90")
        compiled.runtime.cuda_graphs = cuda_graphs
        host_relaid(model, compiled.runtime.executors())
        return compiled.step, compiled.runtime.executors()[0]
    from graphs.executor import Executor
    from graphs.passes import make_plan

    graph = run_passes(model.graph())
    executor = Executor(graph, make_plan(graph, model.params(), "sm90", dot_fp32=True), model.params(), device)

    @torch.inference_mode()
    def step(batch):
        ids, ctx = _inputs(batch, device)
        logits = executor.run({"input_ids": ids}, ctx)["logits"]
        ctx.commit()
        return logits
    return step, executor


# ---- measuring ------------------------------------------------------------------------------------------------------

def measure(step, case: Case, context: SequenceState | None, caches: Caches, vocab: int, device: str,
            target_s: float) -> dict:
    """Median µs of a step: two untimed warm-ups (a first step at a token count, then the one that captures its CUDA
    graphs), then as many runs as fit in about `target_s` (1 to 5)."""
    gen = torch.Generator().manual_seed(case.batch * 7919 + case.tokens)
    states = caches.copies(context, case.batch) if case.kind == "decode" else None

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def run():
        batch_states = states if states is not None else [caches.fresh(2 + i) for i in range(case.batch)]
        batch = [(s, torch.randint(0, vocab, (case.tokens,), generator=gen).tolist()) for s in batch_states]
        sync()
        start = time.perf_counter()
        step(batch)
        sync()
        return time.perf_counter() - start

    first = run()
    run()
    times = [run() for _ in range(max(1, min(5, int(target_s / max(first, 1e-6)))))]
    return {"us": 1e6 * statistics.median(times), "runs": len(times), "warmup_s": round(first, 3)}


def record(path: str, case: Case, result: dict, out: str | None) -> None:
    row = {"path": path, "case": case.name, "tokens": case.num_tokens, **result}
    if "us" in row:
        row["tok_s"] = round(case.num_tokens / row["us"] * 1e6, 1)
        row["us"] = round(row["us"], 1)
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if out:
        Path(out).write_text(json.dumps(ROWS, indent=1))


def print_table(rows: list[dict], roofs: dict[str, dict], paths: list[str]) -> None:
    by = {(r["path"], r["case"]): r for r in rows}
    head = f"{'case':24s} {'tokens':>6s}"
    for p in paths:
        head += f" {p + ' us':>12s} {'tok/s':>9s}"
    head += f" {'roof us':>9s} {'bound':>7s} {'x eager':>7s} {'x compile':>9s} {'% roof':>6s} {'x nogr':>7s}"
    print("\n" + head)
    for case, roof in roofs.items():
        line = f"{case:24s} {roof['tokens']:6d}"
        for p in paths:
            r = by.get((p, case), {})
            line += f" {r['us']:12.1f} {r['tok_s']:9.1f}" if "us" in r else f" {r.get('status', '-')[:22]:>22s}"
        ours = by.get(("sm90", case), {}).get("us")
        ratio = lambda p: f"{by[(p, case)]['us'] / ours:.2f}" if ours and "us" in by.get((p, case), {}) else "-"  # noqa: E731
        bound = "memory" if roof["mem_us"] >= roof["compute_us"] else "compute"
        pct = f"{100 * roof['roof_us'] / ours:.1f}" if ours else "-"
        line += f" {roof['roof_us']:9.1f} {bound:>7s} {ratio('eager'):>7s} {ratio('compile'):>9s} {pct:>6s}" \
                f" {ratio('sm90-nographs'):>7s}"
        print(line)


def build_artifact(path: str, fp8_activations: bool = False, buckets: tuple[int, ...] | None = None) -> None:
    """Compile the full-width slice for sm90 from meta weights (no GPU, no memory) and save the artifact."""
    config = slice_config()
    compiled = deepinfer.compile(DeepseekV41Flash(config, slice_weights(config, "meta")), target="sm90",
                                 fp8_activations=fp8_activations, buckets=buckets)
    compiled.save(path)
    print(f"wrote {path}: {len(compiled.runtime.cubins)} cubins")


def make_step(path: str, model: DeepseekV41Flash, artifact: str | None, device: str):
    if path in ("sm90", "sm90-nographs"):
        return sm90_step(model, artifact, device, cuda_graphs=path == "sm90")
    if path not in ("eager", "compile"):
        raise ValueError(f"unknown path {path!r}: sm90, sm90-nographs, eager or compile")
    cpu_target = deepinfer.compile(model, target="cpu")  # its params: float weights as fp32, quantized ones packed
    params = {k: v.to(device) for k, v in cpu_target.params.items()}
    return interpret_step(cpu_target.graph, params, device, compiled_kernels(cpu_target.graph)
                          if path == "compile" else None)


def run_path(path: str, model: DeepseekV41Flash, todo: list[Case], shared: dict, caches: Caches, args, device: str,
             start: float):
    """Set up one path, check its logits against the first path's on the shared context, then time every case."""
    config = model.config
    try:
        t0 = time.perf_counter()
        step = make_step(path, model, args.artifact, device)
        state = caches.fresh(1 if "context" in shared else 0)
        ids = shared["ids"]  # the context prefill, in chunks of PREFILL_CHUNK: a warm-up and a correctness check
        for begin in range(0, len(ids), PREFILL_CHUNK):
            logits = step([(state, ids[begin: begin + PREFILL_CHUNK])]).float()
        shared.setdefault("context", state)
        ref = shared.setdefault("logits", logits)
        rel, ready_s = float((logits - ref).norm() / ref.norm()), round(time.perf_counter() - t0, 1)
        print(f"{path}: ready in {ready_s} s (context prefill included); logits vs {args.paths.split(',')[0]}: "
              f"rel L2 {rel:.2e}", flush=True)
    except Exception as e:  # one path failing must not hide the others
        for c in todo:
            record(path, c, {"status": f"setup failed: {type(e).__name__}: {str(e)[:300]}"}, args.out)
        return
    for c in todo:
        if time.perf_counter() - start > args.budget:
            record(path, c, {"status": "skipped (budget)"}, args.out)
            continue
        try:
            result = measure(step, c, shared["context"], caches, config.vocab_size, device, 1.0 + (path == "sm90"))
            record(path, c, result | {"setup_s": ready_s, "rel_l2": float(f"{rel:.3g}")}, args.out)
        except torch.cuda.OutOfMemoryError as e:
            record(path, c, {"status": "OOM", "error": str(e)[:300]}, args.out)
        except Exception as e:
            record(path, c, {"status": f"{type(e).__name__}: {str(e)[:300]}"}, args.out)
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="shrink every dimension (runs on a CPU in seconds)")
    p.add_argument("--out", help="write the rows as JSON here (after every measurement)")
    p.add_argument("--artifact", help="a saved sm90 artifact of the slice (else compiled here)")
    p.add_argument("--paths", default="sm90,eager,compile", help="which of sm90, sm90-nographs (no CUDA graphs), eager, compile to run, in order")
    p.add_argument("--cases", default="", help='only these, e.g. "decode B=1,prefill 1024" (default: all)')
    p.add_argument("--budget", type=float, default=300, help="seconds; measurements past it are skipped")
    p.add_argument("--unpaged", action="store_true", help="sequences keep caches of their own, not shared pools")
    p.add_argument("--build-artifact", metavar="DIR", help="only compile the sm90 artifact of the slice into DIR")
    p.add_argument("--fp8-activations", action="store_true", help="the artifact's fp8-weight linears take e4m3 inputs")
    p.add_argument("--buckets", default="", help="the artifact's token-count buckets (default: graphs.plan.BUCKETS)")
    p.add_argument("--context", type=int, default=0, help="tokens each decode sequence has cached (default 1024)")
    args = p.parse_args()
    if args.context < 0:
        p.error(f"--context must be a positive token count, got {args.context}")
    if args.build_artifact:
        build_artifact(args.build_artifact, args.fp8_activations,
                       tuple(int(b) for b in args.buckets.split(",")) if args.buckets else None)
        return 0
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = slice_config(args.small)
    model = DeepseekV41Flash(config, slice_weights(config, device))
    wanted = [x.strip() for x in args.cases.split(",") if x.strip()]
    every = cases(args.small, args.context)
    todo = [c for c in every if not wanted or c.name.split(" ctx=")[0] in wanted]
    roofs = {c.name: {"tokens": c.num_tokens, **roofline(config, model.params(), c)} for c in todo}
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}; torch {torch.__version__}; "
          f"weights {sum(t.numel() * t.element_size() for t in model.params().values()) / 1e9:.1f} GB, made in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(1)  # one sequence's context: each path prefills it, the first one's is cloned
    shared = {"ids": torch.randint(0, config.vocab_size, (every[0].context,), generator=gen).tolist()}
    paths = [x for x in args.paths.split(",") if x]
    longest = max([every[0].context + 8, *(c.tokens for c in todo)])  # decode runs add a token each
    caches = Caches(run_passes(model.graph()), not args.unpaged, max(c.batch for c in todo), longest, device)
    for path in paths:
        run_path(path, model, todo, shared, caches, args, device, start)
        if device == "cuda":
            torch.cuda.empty_cache()
    print_table(ROWS, roofs, paths)
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": ROWS, "roofline": roofs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
