"""From trained fp32 parameters to a checkpoint directory that `DeepseekV41Flash.from_pretrained` and `LLM` load.

The graph's parameters differ from the checkpoint's tensors in three ways, undone here: routed experts are stacked
(`layers.{L}.ffn.experts.w1.weight` [E, ...] back to `layers.{L}.ffn.experts.{j}.w1.weight`), and `hc_stream0` and
`engram.token_map` are derived from the config and tokenizer, so they are not stored. Every tensor is written in
the dtype an unquantized official checkpoint uses for it (bf16; fp32 for hyper-connection mixes, sinks, gate biases
and Engram scales).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from deepinfer.checkpoint import save_checkpoint
from deepinfer.config import DeepseekV41Config
from deepinfer.models.weights import expected_weights

DERIVED = ("hc_stream0", "engram.token_map")
_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(w[123])\.weight$")


def checkpoint_tensors(params: dict[str, torch.Tensor], config: DeepseekV41Config) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (canonical names, official dtypes, on the CPU) from the graph's parameters."""
    specs = expected_weights(config)
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name in DERIVED:
            continue
        t = t.detach().cpu()
        stacked = _STACKED.match(name)
        if stacked:
            prefix, w = stacked.groups()
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.{w}.weight"] = t[j]
        else:
            out[name] = t
    missing = [n for n, s in specs.items() if not s.optional and n not in out]
    unexpected = [n for n in out if n not in specs]
    if missing or unexpected:
        raise ValueError(f"export does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return {name: out[name].to(specs[name].dtype).contiguous() for name in sorted(out)}


def export(params: dict[str, torch.Tensor], config: DeepseekV41Config, directory: str | os.PathLike,
           tokenizer_dir: str | os.PathLike | None = None, record: dict | None = None,
           max_shard_bytes: int | None = None) -> None:
    """Write config.json, the safetensors weights (sharded past `max_shard_bytes`), the tokenizer files and
    train_record.json into `directory`, replacing what a previous export left there."""
    directory = Path(directory)
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    save_checkpoint(checkpoint_tensors(params, config), staging, max_shard_bytes=max_shard_bytes)
    (staging / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(tokenizer_dir) / name, staging / name)
    if record is not None:
        (staging / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
