"""The embedded small models: V4.1-Flash with every kind of layer, trained or with random weights.

`trained_model()` is the default of `LLM()` and `deepinfer generate`: a tiny V4.1-Flash (hidden 256, 8 layers and
3 DSpark draft layers, 11M parameters) trained on the Python standard library's sources with its own 8192-token
tokenizer, shipped as a 24 MB checkpoint in deepinfer/checkpoints/v41-tiny-stdlib (train/README.md tells how it was
made). It writes plausible Python, and its drafts are accepted often enough for DSpark to be measured on it.

`default_model()` is the same architecture with the full V4 vocabulary and random weights, for tests: it exercises
the whole engine (window, encoder and decoder layers, shared compressed KV, indexers and candidates, Engram with the
real tokenizer, MoE, hyper-connections), not the language.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.models import DeepseekV41Flash
from deepinfer.models.engram_layout import engram_layers
from deepinfer.models.weights import expected_weights

TRAINED_CHECKPOINT = Path(__file__).parent / "checkpoints" / "v41-tiny-stdlib"
TRAINED_DESCRIPTION = ("trained on the Python standard library's sources (it writes plausible-looking Python, not "
                       "correct programs; LLM(model) or --model loads a checkpoint)")


def default_checkpoint() -> Path:
    """The directory of the embedded trained checkpoint (config.json, model.safetensors, tokenizer.json), the model
    `LLM()` runs; `LLM(default_checkpoint())` and `DeepseekV41Flash.from_pretrained(default_checkpoint())` load it."""
    return TRAINED_CHECKPOINT


def default_config() -> DeepseekV41Config:
    """8 layers (2 window-only, 3 encoder of ratio 2, 3 decoder of ratio 1), hidden 256, the full vocabulary.

    KV sources 2 and 5; index sources 2, 5 and 7 (7 re-indexes inside 5's candidates); Engram on layers 1 and 4;
    3 DSpark draft layers. Dimensions are multiples of 32 so the fp8 and fp4 cache rounding is on, as in the real
    model. The sparse selection bites early: index_topk 64 drops entries past 64 (64 tokens at ratio 1, 128 at
    ratio 2), and 16 candidate blocks of 8 narrow layer 7's search past 128 tokens.
    """
    config = DeepseekV41Config(
        vocab_size=129280, hidden_size=256, num_hidden_layers=8,
        num_attention_heads=4, head_dim=64, q_lora_rank=64, qk_rope_head_dim=16, o_groups=2, o_lora_rank=64,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 65536},
        sliding_window=128, compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1), kv_source_layer_ids=(2, 5),
        index_source_layer_ids=(2, 5, 7), candidate_source_layer_id=5, candidate_topk_blocks=16,
        candidate_block_size=8, index_n_heads=8, index_head_dim=32, index_topk=64,
        moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        engram_layer_ids=(1, 4), engram_num_embeddings=(0, 0), engram_vocab_size=2000, engram_max_ngram_size=3,
        engram_n_heads=4, engram_head_dim=32,
        num_nextn_predict_layers=3, dspark_markov_rank=32, dspark_n_routed_experts=8, dspark_num_experts_per_tok=2,
        eos_token_id=1,
    )
    # Each Engram layer's table is the sum of its primes: derive it as the model will, not by hand.
    tables = tuple(sum(sum(row) for row in layer.primes) for layer in engram_layers(config).values())
    return config.replace(engram_num_embeddings=tables)


def _init(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """One weight, initialised by what its name says it is (the reference's init where it has one)."""
    module, _, leaf = name.rpartition(".")
    if re.search(r"hc_\w+_fn$", name):
        return torch.randn(shape, generator=gen, dtype=dtype).mul_(0.02)
    if re.search(r"hc_\w+_scale$", name) or leaf in ("q_weight", "k_weight") or name.endswith("embed.scale"):
        return torch.ones(shape, dtype=dtype)
    if re.search(r"hc_\w+_base$", name) or leaf in ("attn_sink", "bias", "bias_vl"):
        return torch.zeros(shape, dtype=dtype)
    if leaf == "weight" and "norm" in module.rpartition(".")[2]:
        return torch.ones(shape, dtype=dtype)
    if leaf == "weight" and module.rpartition(".")[2] == "embed":  # token, Engram and Markov embedding tables
        return torch.randn(shape, generator=gen, dtype=dtype)
    if leaf == "weight" and len(shape) == 2:  # a linear layer [out, in]: unit-scale outputs for unit inputs
        return torch.randn(shape, generator=gen, dtype=dtype).mul_(1 / math.sqrt(shape[1]))
    raise ValueError(f"no initialisation rule for weight {name!r} of shape {shape}")


def random_weights(config: DeepseekV41Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every required weight of `expected_weights(config)`, drawn from a torch.Generator seeded with `seed`.

    Linear weights N(0, 1/fan_in), embeddings N(0, 1), norms 1, hyper-connection fn N(0, 0.02) with base 0 and
    scale 1, sinks and gate biases 0, Engram q/k weights and table scales 1; in the dtype an unquantized official
    checkpoint stores (bf16; fp32 for hyper-connection weights, sinks, gate biases and Engram scales).
    """
    gen = torch.Generator().manual_seed(seed)
    specs = expected_weights(config)
    return {name: _init(name, spec.shape, spec.dtype, gen) for name, spec in sorted(specs.items()) if not spec.optional}


def default_model(seed: int = 0, tokenizer=None) -> DeepseekV41Flash:
    """The random-weight model: `default_config()` with `random_weights(config, seed)` (`LLM(default_model())`).

    `tokenizer` (from `load_tokenizer()`) spares the model loading its own for Engram's token map.
    """
    config = default_config()
    return DeepseekV41Flash(config, random_weights(config, seed), tokenizer=tokenizer)


def trained_model() -> DeepseekV41Flash:
    """The embedded trained checkpoint (`TRAINED_CHECKPOINT`), with its own tokenizer for Engram's token map."""
    from deepinfer.tokenizer import load_tokenizer

    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)
    model.tokenizer = load_tokenizer(TRAINED_CHECKPOINT)
    return model
