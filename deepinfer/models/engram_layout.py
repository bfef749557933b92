"""Engram's hashing constants: the compressed vocabulary, per-layer multipliers, primes and table offsets.

They must match training exactly or the tables are meaningless, so they follow the reference's recipe: the
tokenizer's normalised token texts (NFKC, NFD, accents stripped, lower case, whitespace collapsed) define the
compressed ids; multipliers come from numpy's default_rng(10007 * layer); primes are drawn increasing above
`engram_vocab_size` and never reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import sympy
import torch

from deepinfer.config import DeepseekV41Config


@dataclass(frozen=True)
class EngramLayer:
    multipliers: tuple[int, ...]  # one per look-back, odd
    primes: tuple[tuple[int, ...], ...]  # [n-gram size - 2][head]
    offsets: tuple[int, ...]  # table offset of each (n-gram size, head) column


def engram_layers(config: DeepseekV41Config) -> dict[int, EngramLayer]:
    """The hashing constants of every Engram layer, keyed by layer id."""
    n, heads = config.engram_max_ngram_size, config.engram_n_heads
    bound = max(1, (np.iinfo(np.int64).max // config.engram_compressed_vocab_size) // 2)
    seen: set[int] = set()
    layers = {}
    for layer in config.engram_layer_ids:
        primes = []
        for _ in range(n - 1):
            row, current = [], config.engram_vocab_size - 1
            for _ in range(heads):
                current += 1
                while not sympy.isprime(current) or current in seen:
                    current += 1
                seen.add(current)
                row.append(current)
            primes.append(tuple(row))
        flat = [p for row in primes for p in row]
        offsets = tuple(int(sum(flat[:i])) for i in range(len(flat)))
        rng = np.random.default_rng(10007 * layer)
        mult = rng.integers(low=0, high=bound, size=(n,), dtype=np.int64) * 2 + 1
        layers[layer] = EngramLayer(tuple(int(m) for m in mult), tuple(primes), offsets)
    return layers


def compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """Map every token id to a compressed id shared by tokens whose text normalises alike.

    `tokenizer` is a `tokenizers.Tokenizer`. Returns (map [len(vocab)] int64, compressed vocabulary size).
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a token that is exactly one space from collapsing to ""
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    lookup = np.zeros(size, dtype=np.int64)
    for token_id in range(size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else (normalizer.normalize_str(text) or text)
        lookup[token_id] = keys.setdefault(key, len(keys))
    return torch.from_numpy(lookup), len(keys)
