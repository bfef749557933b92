"""Where the fp4 experts on fragments differ from raw codes on a GPU: each layout run twice (is either nondeterministic?),
the tokens whose outputs differ, and each layout's per-token error against the op's reference (which one is wrong?).

    python bench/fragments_diff.py [--tokens 1,7,64] [--config heuristic|unsplit|prefill] [--experts 384]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_moe_decode import D, LIMIT, TOPK, UNSPLIT, experts  # noqa: E402

from dsl.ops.moe import moe_experts as reference  # noqa: E402
from graphs.plan import bucket_of  # noqa: E402
from kernels.moe.experts import default_config, moe_experts, prescaled  # noqa: E402


def config_of(name: str, tokens: int) -> dict:
    if name == "unsplit":
        return {"up": dict(UNSPLIT), "down": dict(UNSPLIT)}
    return default_config(8192) if name == "prefill" else default_config(bucket_of(tokens))


def diff(tokens: int, name: str, weights: tuple) -> dict:
    raw, frag, scales = weights
    factors = [prescaled(s) for s in scales]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    e = raw[0].shape[0]
    route = torch.stack([torch.randperm(e, device="cuda", generator=g)[:TOPK] for _ in range(tokens)])
    x = torch.randn(tokens, D, device="cuda", generator=g)
    route_weights = torch.rand(tokens, TOPK, device="cuda", generator=g)
    config = config_of(name, tokens)
    runs = {k: [moe_experts(x, route_weights, route, *w, *factors, limit=LIMIT, config=config) for _ in range(2)]
            for k, w in (("raw", raw), ("fragments", frag))}
    want = reference(x.bfloat16().float(), route_weights, route, *raw, *scales, limit=LIMIT)
    err = {k: ((r[0] - want).norm(dim=1) / want.norm(dim=1)) for k, r in runs.items()}  # [T]
    differ = (runs["raw"][0] != runs["fragments"][0]).any(dim=1)
    return {"tokens": tokens, "config": name, "raw_repeats": torch.equal(*runs["raw"]),
            "fragments_repeat": torch.equal(*runs["fragments"]), "tokens_differing": int(differ.sum()),
            "elements_differing": int((runs["raw"][0] != runs["fragments"][0]).sum()),
            "max_abs_diff": float((runs["raw"][0] - runs["fragments"][0]).abs().max()),
            "max_abs": float(want.abs().max()),
            "worst_token_err": {k: float(v.max()) for k, v in err.items()},
            "err_on_differing_tokens": {k: float(v[differ].max()) if differ.any() else 0.0 for k, v in err.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,7,64")
    p.add_argument("--config", default="prefill", choices=["heuristic", "unsplit", "prefill"])
    p.add_argument("--experts", type=int, default=384)
    args = p.parse_args()
    torch.manual_seed(0)
    weights = experts(args.experts)
    for t in (int(v) for v in args.tokens.split(",")):
        print(json.dumps(diff(t, args.config, weights)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
