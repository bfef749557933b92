"""Greedy continuations of corpus prompts by a checkpoint (the engine, greedy, KV-cached): the text drafts meet.

    python -m train.greedy --split train --count 1024 --out train/data/greedy_train.npz
    python -m train.greedy --split heldout --count 64 --out train/data/greedy_heldout.npz

A prompt is `prompt_len` tokens (uniform in [--min-prompt, --max-prompt]) at a random place of the split's token
array, continued greedily up to `--length` tokens in all, so every sequence has the same length (the training
forward batches them). Greedy decoding (and so every accepted draft) conditions on the model's own text, which is
more repetitive than the corpus: drafts trained only on the corpus never see it. train/distill.py mixes these
sequences into its batches; their continuations are on the greedy path by construction.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from deepinfer import LLM, SamplingParams
from train.train import backbone_forward


def random_prompts(ids: np.ndarray, count: int, length: int, prompt_lens: tuple[int, int],
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` prompts of `prompt_lens[0]` to `prompt_lens[1]` tokens at random places of `ids`: (tokens [count,
    length] int64, each prompt then zeros, and the prompt lengths [count])."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(prompt_lens[0], prompt_lens[1] + 1, count)
    starts = rng.integers(0, len(ids) - prompt_lens[1], count)
    tokens = torch.zeros(count, length, dtype=torch.int64)
    for row, (s, n) in enumerate(zip(starts, lens, strict=True)):
        tokens[row, :n] = torch.from_numpy(ids[s : s + n].astype(np.int64))
    return tokens, torch.from_numpy(lens)


def continue_with_engine(checkpoint: Path, prompts: torch.Tensor, lens: torch.Tensor, batch: int = 128) -> torch.Tensor:
    """Greedy continuations of `prompts` [S, L] (the first lens[s] tokens of each) to L tokens, by `LLM`."""
    rows = [p[:n].tolist() for p, n in zip(prompts, lens.tolist(), strict=True)]
    length = prompts.shape[1]
    llm = LLM(str(checkpoint), max_num_seqs=batch, max_num_batched_tokens=max(512, length * batch))
    params = [SamplingParams(max_tokens=length - len(r), temperature=0, ignore_eos=True) for r in rows]
    outs = llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=True)
    return torch.tensor([r + list(o.outputs[0].token_ids) for r, o in zip(rows, outs, strict=True)])


@torch.no_grad()
def continue_by_recompute(graph, params, kernels, prompts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The same continuations by the training forward (train/train.py's `backbone_forward`) over the whole prefix at
    each position, without a cache: slower per token than the engine, but batched wide on whatever device holds
    `params`. prompts [S, L] and lens [S] on that device."""
    seqs = prompts.clone()
    for t in range(int(lens.min()) - 1, seqs.shape[1] - 1):
        logits = backbone_forward(graph, params, kernels, seqs[:, : t + 2])["logits"]  # inputs 0..t
        nxt = logits.reshape(len(seqs), t + 1, -1)[:, t].argmax(-1)
        seqs[:, t + 1] = torch.where(lens <= t + 1, nxt, seqs[:, t + 1])
    return seqs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=Path("deepinfer/checkpoints/v41-tiny-stdlib"))
    p.add_argument("--data", type=Path, default=Path("train/data"))
    p.add_argument("--split", choices=("train", "heldout"), default="train")
    p.add_argument("--count", type=int, default=1024)
    p.add_argument("--length", type=int, default=129, help="tokens per sequence, prompt included")
    p.add_argument("--min-prompt", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not 1 <= args.min_prompt <= args.max_prompt < args.length:
        p.error("need 1 <= --min-prompt <= --max-prompt < --length")
    start = time.perf_counter()
    prompts, lens = random_prompts(np.load(args.data / f"{args.split}_ids.npy"), args.count, args.length,
                                   (args.min_prompt, args.max_prompt), args.seed)
    seqs = continue_with_engine(args.checkpoint, prompts, lens)
    np.savez(args.out, seqs=seqs.numpy(), prompt_lens=lens.numpy())
    print(f"{args.out}: {len(seqs)} sequences of {args.length} tokens, "
          f"{int((args.length - lens).sum())} generated in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
