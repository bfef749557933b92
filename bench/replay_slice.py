"""What bounded replay (`swa_replay_tokens`) would save in a V4.1-Flash prefill on the GPU: the full-width slice's
(bench/bench_slice.py) per-layer prefill times on the sm90 target, projected to the 40-layer model.

Each node of a step is timed between two device synchronisations (bench/node_timing.py; no CUDA graphs) and
charged to its layer and to one of three parts: the KV source's full-length work (compressor, indexer keys), the
indexer's query side (scores, candidates, top-k), and the rest (attention, MoE, mixes). Two steps are timed:
a prefill of T tokens on a fresh sequence (every layer over T rows: the exact prefill), and a chunk of K tokens after
T - K tokens of context (the decoder rows of a replayed prefill, over the same caches). The slice's layers stand for
the model's: 0 for the window layers 0-1, 1 for the encoder sources 2, 8, 14 (its rest part for the other encoder
layers), 2 for layer 20 (the first decoder layer, KV and candidate source), 3 for the plain decoder layers; the
re-indexing decoder layers 24, 28, 32, 36 are charged as layer 3 plus layer 2's indexer query side. Exact: every
layer at T. Replay: layers 0-19 at T, layer 20's KV-source part at T and its other parts at K, layers 21-39 at K.

    python bench/replay_slice.py [--artifact artifacts/slice-sm90] [--tokens 2048,8192] [--keep 140] [--out x.json]
    python bench/replay_slice.py --small --tokens 64 --keep 12   # every dimension shrunk: a CPU check of the script
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import time
from pathlib import Path

import torch
from bench_slice import slice_config, slice_weights, sm90_runner  # sets TRITON_INTERPRET without a GPU
from node_timing import timer
from slice_caches import Caches

from deepinfer.models import DeepseekV41Flash
from dsl.passes import run_passes

SOURCE_OPS = {"compress_pool", "rope_entries", "rope_entries_fp4_round", "rms_norm_rope_entries_fp4_round",
              "cache_append"}
INDEX_OPS = {"index_scores", "candidate_blocks", "topk_select"}
# The 40-layer model as slice layers: (slice layer, part or None for the whole layer, count) for the encoder half
# (always over every token) and the decoder half (over the kept tokens in replay), the first decoder layer apart.
ENCODER_HALF = [(0, None, 2), (1, None, 3), (1, "rest", 15)]
DECODER_HALF = [(3, None, 15), (3, None, 4), (2, "index", 4)]


def node_parts(graph, num_layers: int) -> list[tuple[str, str]]:
    """Per node: (its layer, "layer L" or "embed" / "head", and its part: "source", "index" or "rest"). A node is
    charged by the weights it reads, else by its op, else as the node that made its first input."""
    made: dict = {}
    out, last = [], ("embed", "rest")
    for node in graph.nodes:
        names = [v.name for v in node.inputs if v is not None and v.name in graph.params]
        layers = [int(m.group(1)) for n in names if (m := re.match(r"layers\.(\d+)\.", n))]
        producer = next((made[v] for v in node.inputs if v is not None and v in made), last)
        if layers:
            layer = f"layer {layers[0]}"
        elif any(n.startswith(("norm.", "head.")) for n in names):
            layer = "head"
        elif "layer" in node.attrs and node.attrs["layer"] < num_layers:
            layer = f"layer {node.attrs['layer']}"
        else:
            layer = producer[0]
        if any(".compressor." in n or ".indexer.wk" in n or ".indexer.k_norm" in n for n in names) or \
                node.op in SOURCE_OPS:
            part = "source"
        elif any(".indexer." in n for n in names) or node.op in INDEX_OPS:
            part = "index"
        elif not names and node.op != "sparse_attention" and producer[1] != "rest":
            part = producer[1]
        else:
            part = "rest"
        last = (layer, part)
        out.append(last)
        for v in node.outputs:
            made[v] = last
    return out


def timed_step(step, executor, parts: list[tuple[str, str]], batch, device: str) -> tuple[dict, float]:
    """ms by (layer, part) of one step synchronised node by node, and the step's ms."""
    ms, calls = collections.Counter(), collections.Counter()
    timed, node = timer(ms, calls), executor._node
    executor._node = lambda i, *a: timed(parts[i], node, i, *a)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        sync()
        start = time.perf_counter()
        step(batch)
        sync()
        return dict(ms), 1e3 * (time.perf_counter() - start)
    finally:
        executor._node = node


def layer_ms(ms: dict, layer: int, part: str | None) -> float:
    return sum(v for (name, p), v in ms.items() if name == f"layer {layer}" and (part is None or p == part))


def project(full: dict, kept: dict) -> dict:
    """The 40-layer model's prefill ms, exact and replayed, from the slice's per-layer ms over T rows (`full`) and
    over the K decoder rows after T - K of context (`kept`)."""
    other = sum(v for (name, _), v in full.items() if not name.startswith("layer "))  # embedding, head
    encoder = sum(n * layer_ms(full, layer, part) for layer, part, n in ENCODER_HALF)
    first_exact = layer_ms(full, 2, None)
    first_replay = layer_ms(full, 2, "source") + layer_ms(kept, 2, "index") + layer_ms(kept, 2, "rest")
    decoder_exact = sum(n * layer_ms(full, layer, part) for layer, part, n in DECODER_HALF)
    decoder_replay = sum(n * layer_ms(kept, layer, part) for layer, part, n in DECODER_HALF)
    exact = other + encoder + first_exact + decoder_exact
    replay = other + encoder + first_replay + decoder_replay
    return {"exact_ms": exact, "replay_ms": replay, "saved": 1 - replay / exact,
            "decoder_half_exact_ms": first_exact + decoder_exact,
            "decoder_half_replay_ms": first_replay + decoder_replay}


def measure(step, executor, parts, caches: Caches, tokens: int, keep: int, vocab: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
    step([(caches.fresh(0), ids)])  # warm-up: kernels load
    full, full_total = timed_step(step, executor, parts, [(caches.fresh(0), ids)], device)
    kept = {}
    for timed in (False, True):  # the first loads the K-token chunk's kernels
        state = caches.fresh(1)
        step([(state, ids[: tokens - keep])])
        if timed:
            kept, kept_total = timed_step(step, executor, parts, [(state, ids[tokens - keep:])], device)
        else:
            step([(state, ids[tokens - keep:])])
    by_layer = {f"{name} {part}": [round(full[(name, part)], 3), round(kept.get((name, part), 0.0), 3)]
                for name, part in sorted(full)}
    return {"tokens": tokens, "keep": keep, "prefill_ms_synchronised": full_total, "chunk_ms_synchronised": kept_total,
            "ms_by_layer_part [T rows, K rows]": by_layer, "projected_40_layers": project(full, kept)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="shrink every dimension (a CPU check of the script)")
    p.add_argument("--artifact", help="a saved sm90 artifact of the slice (else compiled here)")
    p.add_argument("--tokens", default="2048,8192", help="prompt lengths T")
    p.add_argument("--keep", type=int, default=140, help="swa_replay_tokens K")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = slice_config(args.small)
    model = DeepseekV41Flash(config, slice_weights(config, device))
    step, executor = sm90_runner(model, args.artifact, device, cuda_graphs=False)
    parts = node_parts(executor.graph, config.num_hidden_layers)
    tokens = [int(t) for t in args.tokens.split(",")]
    caches = Caches(run_passes(model.graph()), True, 2, max(tokens), device)
    rows = []
    for t in tokens:
        rows.append(measure(step, executor, parts, caches, t, args.keep, config.vocab_size, device))
        print(json.dumps(rows[-1]["projected_40_layers"] | {"tokens": t, "keep": args.keep}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
