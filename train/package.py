"""Package a trained export as the embedded checkpoint: one safetensors file, tokenizer, and the training record
with greedy samples and the held-out loss measured on the shipped (bf16) weights.

    python -m train.package out/v41-tiny-stdlib deepinfer/checkpoints/v41-tiny-stdlib
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np
import torch

from deepinfer.checkpoint import load_checkpoint, save_checkpoint
from deepinfer.config import DeepseekV41Config

PROMPTS = ("def fib(n):", "import os\n", "class Stack:", "    def __init__(self", "for i in range(")
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")


def heldout_loss(directory: Path, data: Path, seqs: int = 8, seq_len: int = 512) -> float:
    """Mean next-token loss of the shipped weights on `seqs` evenly spaced held-out sequences, via the cpu target."""
    import deepinfer
    from deepinfer.models import DeepseekV41Flash

    ids = torch.from_numpy(np.load(data / "heldout_ids.npy").astype(np.int64))
    offsets = np.linspace(0, len(ids) - seq_len - 1, seqs).astype(np.int64)
    batch = torch.stack([ids[s : s + seq_len + 1] for s in offsets])
    compiled = deepinfer.compile(DeepseekV41Flash.from_pretrained(directory), "cpu")
    logits = compiled.forward(batch[:, :-1])
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))


def greedy_samples(directory: Path, max_tokens: int = 64) -> dict[str, str]:
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(directory))
    outs = llm.generate(list(PROMPTS), SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return {prompt: out.outputs[0].text for prompt, out in zip(PROMPTS, outs, strict=True)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("export", type=Path, help="what train/train.py exported (possibly sharded)")
    p.add_argument("target", type=Path, help="the checkpoint directory to write")
    p.add_argument("--data", type=Path, default=Path("train/data"))
    args = p.parse_args()
    config = DeepseekV41Config.from_pretrained(args.export)
    tensors = load_checkpoint(args.export, config)
    shutil.rmtree(args.target, ignore_errors=True)
    save_checkpoint(tensors, args.target)
    for name in FILES:
        shutil.copy(args.export / name, args.target / name)
    record = json.loads((args.export / "train_record.json").read_text())
    record["args"].pop("out", None)
    record["shipped"] = {"heldout_loss_8x512_bf16": round(heldout_loss(args.target, args.data), 4),
                         "greedy_samples": greedy_samples(args.target)}
    (args.target / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["shipped"], indent=1))
    total = sum(f.stat().st_size for f in args.target.iterdir())
    print(f"{args.target}: {total / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
