"""The trained tiny model's config: `default_config()`'s architecture on the stdlib tokenizer's 8192-token vocabulary.

Same schedule as the random default (2 window-only, 3 encoder and 3 decoder layers; KV sources 2 and 5; index sources
2, 5 and 7 with 5 as the candidate source; Engram on layers 1 and 4; 3 DSpark draft layers), with smaller experts so
that the bf16 checkpoint is about 23 MB. The special ids are the tokenizer's; Engram's compressed vocabulary is
measured on it and its tables are derived from the primes, as `default_config()` does.
"""

from __future__ import annotations

import math

from deepinfer.config import DeepseekV41Config
from deepinfer.default_model import default_config
from deepinfer.models.engram_layout import compressed_token_map, engram_layers
from deepinfer.models.weights import expected_weights


def tiny_config(tokenizer) -> DeepseekV41Config:
    """`tokenizer` is a `tokenizers.Tokenizer` with train/bpe.py's special tokens."""
    _, compressed = compressed_token_map(tokenizer)
    ids = {name: tokenizer.token_to_id(f"<|{name}|>") for name in ("bos", "eos", "pad", "noise")}
    config = default_config().replace(
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        moe_intermediate_size=64, n_routed_experts=6, num_experts_per_tok=2,
        engram_vocab_size=600, engram_compressed_vocab_size=compressed, engram_pad_id=ids["pad"],
        dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, dspark_noise_token_id=ids["noise"],
        bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
        max_position_embeddings=65536,
    )
    tables = tuple(sum(sum(row) for row in layer.primes) for layer in engram_layers(config).values())
    return config.replace(engram_num_embeddings=tables)


def checkpoint_bytes(config: DeepseekV41Config) -> int:
    """Bytes of the unquantized checkpoint: bf16, fp32 where `expected_weights` says so."""
    return sum(math.prod(s.shape) * s.dtype.itemsize for s in expected_weights(config).values() if not s.optional)


if __name__ == "__main__":
    from tokenizers import Tokenizer

    config = tiny_config(Tokenizer.from_file("train/data/tokenizer.json"))
    print(config.to_dict())
    print(f"checkpoint: {checkpoint_bytes(config) / 1e6:.1f} MB")
