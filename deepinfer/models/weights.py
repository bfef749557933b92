"""Every tensor a DeepSeek-V4.1 text checkpoint holds for a config: canonical name, logical shape, storage format.

Names are the official checkpoint's without the optional `model.` prefix (`head.weight`, not `lm_head.weight`).
Which weights may be stored quantized follows DeepSeek's own release (deepinfer 0.1.0, `hugging_face/` and
`v4_modules/`): fp8 e4m3 with 32 x 32 ue8m0 blocks for the attention projections (`wq_a`, `wq_b`, `wkv`, `wo_a`,
`wo_b`), the indexer's `wq_b`, the shared experts, Engram's `wkv` and DSpark's `main_proj`; fp4 e2m1 for the routed
experts; the Engram table `engram.embed.weight` in e4m3 with one scale per 32 values of a row, the scale being the
model tensor `engram.embed.scale`. The compressor, the indexer's `wk` and `weights_proj`, the router, norms, sinks,
hyper-connection mixes, embeddings and heads are always float.

DSpark draft layers `mtp.{i}.` are blocks like a window-only backbone layer with their own MoE size; the first one
also holds `main_proj` / `main_norm` (the projection of the target layers' features), the last one the output side:
`norm`, `markov_head.{embed,head}`, `confidence_head.proj` (and `hc_head_*` in checkpoints without single-pass
hyper-connections). `embed` and `head` are shared with the backbone and not stored again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from deepinfer.config import DeepseekV41Config

QUANT_BLOCK = 32
_ROUTED_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.")  # `layers.3.ffn.experts.17.w1.weight`


@dataclass(frozen=True)
class WeightSpec:
    """One checkpoint tensor: logical (dequantized) shape, the quantized format it may be stored in, and the float
    dtype an unquantized official checkpoint uses for it (any float dtype loads)."""

    shape: tuple[int, ...]
    quant: str | None = None  # None | "fp8" | "fp4"
    dtype: torch.dtype = torch.bfloat16
    optional: bool = False
    scale_block: tuple[int, int] = (QUANT_BLOCK, QUANT_BLOCK)  # values per scale: (rows, columns)

    def quantized_shape(self) -> tuple[int, ...]:
        """Shape of the stored codes: as logical for fp8, two codes per byte along the input dim for fp4."""
        if self.quant == "fp4":
            return (self.shape[0], self.shape[1] // 2)
        return self.shape

    def scale_shape(self) -> tuple[int, int]:
        """Shape of `<module>.scale` when stored quantized: [ceil(O / rows), ceil(I / columns)] of `scale_block`."""
        (o, i), (rows, cols) = self.shape, self.scale_block
        return (-(-o // rows), -(-i // cols))


def _float(*shape: int, dtype: torch.dtype = torch.bfloat16, optional: bool = False) -> WeightSpec:
    return WeightSpec(tuple(shape), None, dtype, optional)


def _fp8(*shape: int) -> WeightSpec:
    return WeightSpec(tuple(shape), "fp8")


def _fp4(*shape: int) -> WeightSpec:
    return WeightSpec(tuple(shape), "fp4", scale_block=(1, QUANT_BLOCK))


def _hc_site(site: str, c: DeepseekV41Config) -> dict[str, WeightSpec]:
    fp32 = torch.float32
    return {f"hc_{site}_fn": _float(c.mix_hc, c.hc_mult * c.hidden_size, dtype=fp32),
            f"hc_{site}_base": _float(c.mix_hc, dtype=fp32),
            f"hc_{site}_scale": _float(3, dtype=fp32)}


def _hc_head(c: DeepseekV41Config) -> dict[str, WeightSpec]:
    # Only checkpoints without single-pass hyper-connections carry a separate final collapse.
    fp32 = torch.float32
    return {"hc_head_fn": _float(c.hc_mult, c.hc_mult * c.hidden_size, dtype=fp32, optional=True),
            "hc_head_base": _float(c.hc_mult, dtype=fp32, optional=True),
            "hc_head_scale": _float(1, dtype=fp32, optional=True)}


def _attention(c: DeepseekV41Config, layer: int | None) -> dict[str, WeightSpec]:
    """`attn.*` of a backbone layer, or of a draft layer (window only) when `layer` is None."""
    d, h = c.head_dim, c.hidden_size
    out = {"attn.wq_a.weight": _fp8(c.q_lora_rank, h),
           "attn.q_norm.weight": _float(c.q_lora_rank),
           "attn.wq_b.weight": _fp8(c.num_attention_heads * d, c.q_lora_rank),
           "attn.wkv.weight": _fp8(d, h),
           "attn.kv_norm.weight": _float(d),
           "attn.wo_a.weight": _fp8(c.o_groups * c.o_lora_rank, c.num_attention_heads * d // c.o_groups),
           "attn.wo_b.weight": _fp8(h, c.o_groups * c.o_lora_rank),
           "attn.attn_sink": _float(c.num_attention_heads, dtype=torch.float32)}
    if layer is None:
        return out
    is_kv_source, is_index_source = layer in c.kv_source_layer_ids, layer in c.index_source_layer_ids
    if is_kv_source:
        out["attn.compressor.wkv.weight"] = _float(d, h)
        if c.compress_ratios[layer] != 1:
            out["attn.compressor.wgate.weight"] = _float(d, h)
        out["attn.compressor.norm.weight"] = _float(d)
    if is_index_source:
        out["attn.indexer.wq_b.weight"] = _fp8(c.index_n_heads * c.index_head_dim, c.q_lora_rank)
        out["attn.indexer.weights_proj.weight"] = _float(c.index_n_heads, h)
    if is_kv_source and is_index_source:
        # The indexer keys are made once per KV source, from its latent; later index layers read them.
        out["attn.indexer.wk.weight"] = _float(c.index_head_dim, d)
        out["attn.indexer.k_norm.weight"] = _float(c.index_head_dim)
    return out


def _moe(c: DeepseekV41Config, n_experts: int) -> dict[str, WeightSpec]:
    h, m = c.hidden_size, c.moe_intermediate_size
    out = {"ffn.gate.weight": _float(n_experts, h),
           "ffn.gate.bias": _float(n_experts, dtype=torch.float32),
           "ffn.gate.bias_vl": _float(n_experts, dtype=torch.float32)}
    for j in range(n_experts):
        out |= {f"ffn.experts.{j}.w1.weight": _fp4(m, h),
                f"ffn.experts.{j}.w2.weight": _fp4(h, m),
                f"ffn.experts.{j}.w3.weight": _fp4(m, h)}
    if c.n_shared_experts:
        s = c.n_shared_experts * m
        out |= {"ffn.shared_experts.w1.weight": _fp8(s, h),
                "ffn.shared_experts.w2.weight": _fp8(h, s),
                "ffn.shared_experts.w3.weight": _fp8(s, h)}
    return out


def _engram(c: DeepseekV41Config, layer: int) -> dict[str, WeightSpec]:
    rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
    d, h = c.engram_head_dim, c.hidden_size
    return {"engram.embed.weight": WeightSpec((rows, d), "fp8", scale_block=(1, QUANT_BLOCK)),
            "engram.embed.scale": _float(rows, -(-d // QUANT_BLOCK), dtype=torch.float32),
            "engram.wkv.weight": _fp8(h * (c.hc_mult + 1), c.engram_n_hash_cols * d),
            "engram.q_weight": _float(c.hc_mult, h),
            "engram.k_weight": _float(c.hc_mult, h)}


def _block(c: DeepseekV41Config, layer: int | None, n_experts: int) -> dict[str, WeightSpec]:
    h = c.hidden_size
    out = {**_hc_site("attn", c), **_hc_site("ffn", c),
           "attn_norm.weight": _float(h), "ffn_norm.weight": _float(h)}
    out |= _attention(c, layer)
    out |= _moe(c, n_experts)
    if layer is not None and layer in c.engram_layer_ids:
        out |= _engram(c, layer)
    return out


def _draft_layer(c: DeepseekV41Config, i: int) -> dict[str, WeightSpec]:
    h = c.hidden_size
    out = _block(c, None, c.dspark_n_routed_experts)
    if i == 0:
        out |= {"main_proj.weight": _fp8(h, len(c.dspark_target_layer_ids) * h), "main_norm.weight": _float(h)}
    if i == c.num_nextn_predict_layers - 1:
        out |= {"norm.weight": _float(h),
                "markov_head.embed.weight": _float(c.vocab_size, c.dspark_markov_rank),
                "markov_head.head.weight": _float(c.vocab_size, c.dspark_markov_rank),
                "confidence_head.proj.weight": _float(1, h + c.dspark_markov_rank)}
        out |= _hc_head(c)
    return out


def expected_weights(config: DeepseekV41Config) -> dict[str, WeightSpec]:
    """Canonical name -> `WeightSpec` for every tensor of the V4.1 text model (backbone and DSpark draft layers)."""
    c, h = config, config.hidden_size
    specs = {"embed.weight": _float(c.vocab_size, h),
             "head.weight": _float(c.vocab_size, h, optional=c.tie_word_embeddings),
             "norm.weight": _float(h)}
    specs |= _hc_head(c)
    for layer in range(c.num_hidden_layers):
        specs |= {f"layers.{layer}.{k}": v for k, v in _block(c, layer, c.n_routed_experts).items()}
    for i in range(c.num_nextn_predict_layers):
        specs |= {f"mtp.{i}.{k}": v for k, v in _draft_layer(c, i).items()}
    return specs


@dataclass(frozen=True)
class ExpertShard:
    """Rank `rank` of `world_size`: it holds a contiguous 1 / world_size of every MoE layer's routed experts."""

    rank: int
    world_size: int

    def experts(self, num_experts: int) -> range:
        """The expert ids this rank holds of a layer of `num_experts` (which the ranks must divide evenly)."""
        if num_experts % self.world_size:
            raise ValueError(f"{num_experts} routed experts do not split evenly over expert_parallel_size="
                             f"{self.world_size}: choose a size that divides every MoE layer's expert count")
        share = num_experts // self.world_size
        return range(self.rank * share, (self.rank + 1) * share)

    def holds(self, name: str, config: DeepseekV41Config) -> bool:
        """Whether this rank loads the checkpoint tensor `name` (canonical): all but other ranks' routed experts."""
        m = _ROUTED_EXPERT.match(name)
        if m is None:
            return True
        total = config.n_routed_experts if m[1] == "layers" else config.dspark_n_routed_experts
        return int(m[2]) in self.experts(total)
