"""Every logit the cpu target computes over a fixed set of runs, saved, or compared bit for bit with a saved set: the
check that a change to the interpreter, the ops' references or the engine leaves the cpu target's outputs as they were.

    python bench/logit_record.py --save /tmp/before.pt      # on the tree before the change
    python bench/logit_record.py --compare /tmp/before.pt   # after it: exits 1 at the first difference

The runs, for each model (`--models`: v41-tiny, v41-smooth, v41-tiny-engram and the embedded checkpoint by default):
`LLM.generate` of 8 prompts of 64 random tokens and of the first of them alone, 24 greedy tokens each, batch-invariant
(the default) and not; then stateless forwards (`CompiledModel.forward`: fresh sequences, every row's logits) of two
40-token prompts, and incremental steps of three sequences (chunks of 5, 17 and 1 tokens, then 4 decode steps) in
both modes. Every `CompiledModel.step` of the engine is recorded (its logits in call order), with the tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.default_model import default_checkpoint  # noqa: E402
from graphs.compiled_model import CompiledModel  # noqa: E402

MODELS = ["tests/fixtures/v41-tiny", "tests/fixtures/v41-smooth", "tests/fixtures/v41-tiny-engram", "default"]


def record_engine(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of every step of one `generate` call, then its tokens."""
    seen: list[torch.Tensor] = []
    step = CompiledModel.step

    def recording(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        seen.append(out.clone())
        return out

    CompiledModel.step = recording
    try:
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        CompiledModel.step = step
    return [*seen, torch.tensor([list(o.outputs[0].token_ids) for o in outs])]


def record_model(model: CompiledModel, vocab: int, batch_invariant: bool) -> list[torch.Tensor]:
    """Stateless forwards and incremental steps of unpaged sequences."""
    g = torch.Generator().manual_seed(1)
    out = [model.forward(torch.randint(0, vocab, (2, 40), generator=g))] if not batch_invariant else []
    states = [model.new_sequence() for _ in range(3)]
    chunks = [[int(t) for t in torch.randint(0, vocab, (n,), generator=g)] for n in (5, 17, 1)]
    out.append(model.step(list(zip(states, chunks, strict=True)), batch_invariant=batch_invariant))
    for _ in range(4):
        tokens = [[int(t)] for t in torch.randint(0, vocab, (3,), generator=g)]
        out.append(model.step(list(zip(states, tokens, strict=True)), batch_invariant=batch_invariant))
    return out


def record(name: str) -> dict[str, list[torch.Tensor]]:
    path = default_checkpoint() if name == "default" else str(ROOT / name)
    runs = {}
    for batch_invariant in (True, False):
        llm = LLM(path, target="cpu", batch_invariant=batch_invariant)
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, llm.config.vocab_size, (8, 64), generator=g).tolist()
        tag = "invariant" if batch_invariant else "plain"
        runs[f"{tag} generate x8"] = record_engine(llm, prompts)
        runs[f"{tag} generate x1"] = record_engine(llm, prompts[:1])
        runs[f"{tag} steps"] = record_model(llm.compiled, llm.config.vocab_size, batch_invariant)
    return runs


def compare(saved: dict, now: dict) -> list[str]:
    """Where `now` differs from `saved`, bit for bit (NaNs in the same places count as equal)."""
    problems = []
    for model, runs in saved.items():
        for run, tensors in runs.items():
            got = now[model][run]
            if len(got) != len(tensors):
                problems.append(f"{model} {run}: {len(got)} tensors, saved {len(tensors)}")
                continue
            for i, (a, b) in enumerate(zip(tensors, got, strict=True)):
                if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)):
                    problems.append(f"{model} {run}: tensor {i} differs")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--save")
    group.add_argument("--compare")
    p.add_argument("--models", default=",".join(MODELS))
    args = p.parse_args()
    names = args.models.split(",")
    now = {name: record(name) for name in names}
    if args.save:
        torch.save(now, args.save)
        print(f"saved {sum(len(t) for r in now.values() for t in r.values())} tensors to {args.save}")
        return 0
    saved = {k: v for k, v in torch.load(args.compare).items() if k in names}
    problems = compare(saved, now)
    print("\n".join(problems) or f"bitwise equal: {sum(len(t) for r in saved.values() for t in r.values())} tensors")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
