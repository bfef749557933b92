"""The cpu target's `LLM.generate` against the reference's own `generate`, on the same prompts, side by side.

    python bench/cpu_vs_reference.py --reference-dir /work/reference     # v41-tiny, batches 1 and 8
    python bench/cpu_vs_reference.py --reference-dir DIR --model tests/fixtures/v41-smooth --batches 1,8 --rounds 3

Each side runs in a process of its own, one after the other (ours, then the reference, for each batch, `--rounds`
times): `--batches` prompts of `--prompt-tokens` random token ids (seeded, the same on both sides), `--max-tokens`
greedy tokens each (no early stop), OMP_NUM_THREADS=`--threads`. A process warms up with one `generate` on the
prompts, then times `--repeats` more; tokens/s is generated tokens over the call's wall time (prefill included).
Ours is `LLM(model, target="cpu")` in its default (batch-invariant) mode; the reference is the `deepseek_v41` model of
the transformers repository in fp32, `model.generate(ids, do_sample=False)`. The ratio is ours over the reference,
per round, from the medians of each side's repeats. The reference's first forward is checked against the fixture's
own outputs (`oracle.npz`, made by that same reference) before anything is timed.

The reference is kept out of this repository. `--reference-dir` holds a package `deepseek_v41/` made of the files
`configuration_deepseek_v41.py` and `modeling_deepseek_v41.py` of huggingface/transformers'
`src/transformers/models/deepseek_v41/` (the stored copy read here: commit 0a2080b43eb6), their relative imports
(`from ...utils import ...`) made absolute (`from transformers.utils import ...`), and an `__init__.py` importing
`DeepseekV41ForCausalLM` and `DeepseekV41TextConfig`. They run over the installed transformers' utilities, which lack
this model, with two adaptations made here (`_reference_model`), and nothing else changed:
- the cache layer type `shared_compressed_attention` gets its config when `DynamicCache(config=...)` builds it, as
  the repository's own cache utilities do once they know the type;
- `generate` of transformers 5.25 hands the cache to the model as `cache=`, which the model file reads as
  `past_key_values`: the keyword is passed on under that name.
The editable install of this project maps a top-level package `kernels`, which transformers takes for the Hugging
Face package of that name; the reference's process drops that mapping before importing transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def prompts(vocab_size: int, batch: int, tokens: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `tokens` ids drawn from a seeded generator: the same on both sides."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, tokens), generator=generator).tolist()


def time_calls(call, repeats: int) -> tuple[list[float], list[list[int]]]:
    """One warm-up call, then the wall seconds of `repeats` calls; the last call's tokens."""
    tokens = call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = call()
        seconds.append(time.perf_counter() - start)
    return seconds, tokens


def run_ours(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    from deepinfer import LLM, SamplingParams

    llm = LLM(args.model, target="cpu")
    ids = prompts(llm.config.vocab_size, args.batch, args.prompt_tokens, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in ids]

    def call() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]

    seconds, tokens = time_calls(call, args.repeats)
    return {"seconds": seconds, "tokens": tokens}


def _reference_model(reference_dir: str, model_dir: str):
    """The reference model in fp32 with the checkpoint's weights (see the module docstring for the adaptations)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("__editable__")]
    sys.path.insert(0, reference_dir)
    import torch
    import transformers.cache_utils as cache_utils
    from safetensors.torch import load_file

    try:
        from deepseek_v41 import DeepseekV41ForCausalLM, DeepseekV41TextConfig
    except ImportError as e:
        raise SystemExit(f"no reference model under {reference_dir} ({e}); the module docstring says how to make it")

    layer_kinds = cache_utils.get_layer_types_and_kwargs

    def with_config(config):
        types, kwargs = layer_kinds(config)
        return types, [dict(k, config=config) if t == "shared_compressed_attention" else k
                       for t, k in zip(types, kwargs, strict=True)]

    cache_utils.get_layer_types_and_kwargs = with_config

    class Reference(DeepseekV41ForCausalLM):
        def forward(self, *args, cache=None, **kwargs):
            if cache is not None and kwargs.get("past_key_values") is None:
                kwargs["past_key_values"] = cache
            return super().forward(*args, **kwargs)

    fields = json.loads((Path(model_dir) / "config.json").read_text())
    fields = fields.get("text_config", fields)
    config = DeepseekV41TextConfig(**{k: v for k, v in fields.items() if k not in ("model_type",
                                                                                  "transformers_version")})
    model = Reference(config).float().eval()
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    model.load_state_dict({("lm_head.weight" if k == "head.weight" else f"model.{k}"): v.float()
                           for k, v in weights.items()}, strict=True)
    return model


def check_reference(model, model_dir: str) -> float | None:
    """Relative L2 distance of the reference's prompt logits from the fixture's (None: the model has no oracle)."""
    import numpy as np
    import torch

    oracle = Path(model_dir) / "oracle.npz"
    if not oracle.exists():
        return None
    data = np.load(oracle)
    with torch.inference_mode():
        logits = model(torch.from_numpy(data["input_ids"]).long()).logits
    expected = torch.from_numpy(data["logits"])
    return float((logits - expected).norm() / expected.norm())


def run_reference(args: argparse.Namespace) -> dict:
    import torch

    model = _reference_model(args.reference_dir, args.model)
    distance = check_reference(model, args.model)
    spread = Path(args.model) / "spread.json"
    limit = json.loads(spread.read_text())["max_rel_prompt"] if spread.exists() else 1e-4
    if distance is not None and distance > limit:
        raise SystemExit(f"the reference's prompt logits are {distance:.3g} from the fixture's (its spread: "
                         f"{limit:.3g}): not the reference that made it")
    ids = torch.tensor(prompts(model.config.vocab_size, args.batch, args.prompt_tokens, args.seed))

    def call() -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                 min_new_tokens=args.max_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    seconds, tokens = time_calls(call, args.repeats)
    return {"seconds": seconds, "tokens": tokens, "oracle_distance": distance}


def side(args: argparse.Namespace, name: str, batch: int) -> dict:
    """Run one side in its own process; its JSON result."""
    command = [sys.executable, str(Path(__file__).resolve()), "--side", name, "--batch", str(batch),
               "--model", args.model, "--reference-dir", args.reference_dir, "--prompt-tokens",
               str(args.prompt_tokens), "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats),
               "--seed", str(args.seed)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"the {name} side failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reference-dir", default=os.environ.get("DEEPSEEK_V41_REFERENCE", "/work/reference"))
    p.add_argument("--model", default=str(ROOT / "tests/fixtures/v41-tiny"))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed generate calls a process, after one warm-up")
    p.add_argument("--rounds", type=int, default=1, help="times each batch's pair of processes runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side", choices=("ours", "reference"), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        print(json.dumps((run_ours if args.side == "ours" else run_reference)(args)))
        return 0
    if not (Path(args.reference_dir) / "deepseek_v41").is_dir():
        raise SystemExit(f"no reference under {args.reference_dir}/deepseek_v41: the module docstring says how to "
                         "make it (or pass --reference-dir)")
    print(f"{args.model}: {args.prompt_tokens}-token prompts, {args.max_tokens} greedy tokens, {args.threads} "
          f"threads, load {os.getloadavg()[0]:.1f}")
    for batch in (int(b) for b in args.batches.split(",")):
        for round_ in range(args.rounds):
            ours, reference = side(args, "ours", batch), side(args, "reference", batch)
            rates = {}
            for name, result in (("ours", ours), ("reference", reference)):
                rates[name] = [batch * args.max_tokens / s for s in result["seconds"]]
            same = sum(a == b for x, y in zip(ours["tokens"], reference["tokens"], strict=True)
                       for a, b in zip(x, y, strict=True))
            ratio = statistics.median(rates["ours"]) / statistics.median(rates["reference"])
            print(f"batch {batch} round {round_ + 1}: ours {' '.join(f'{r:.1f}' for r in rates['ours'])} tok/s, "
                  f"reference {' '.join(f'{r:.1f}' for r in rates['reference'])} tok/s; ratio {ratio:.2f}x "
                  f"(medians); same tokens {same}/{batch * args.max_tokens}; reference vs fixture "
                  f"{reference['oracle_distance']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
