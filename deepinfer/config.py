"""The DeepSeek-V4.1 text configuration, with the per-layer schedule derived as the reference derives it.

Field names are those of the Hugging Face `config.json` (flat, or nested under `text_config`), so a real
checkpoint's config loads unchanged. Unknown keys are ignored; the derived schedule (compress ratios, KV and
index sources, the candidate source, rope parameters) is filled in and validated in `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

_DEFAULT_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
_DEFAULT_KV_SOURCES = (2, 8, 14, 20)
_DEFAULT_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)


_SCHEDULE_FIELDS = ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id",
                    "dspark_target_layer_ids")


# Fields that must be finite and > 0: a rope theta of 0 or a negative epsilon gives NaN or garbage, silently.
_POSITIVE_NUMBERS = ("rope_theta", "compress_rope_theta", "rms_norm_eps", "hc_eps", "gate_temp",
                     "routed_scaling_factor", "swiglu_limit")
# Fields every weight's shape depends on: a config.json without one would load the released model's value and
# report hundreds of misshapen tensors instead of the missing field.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                "o_groups", "o_lora_rank", "moe_intermediate_size", "n_routed_experts")


class ConfigError(ValueError):
    """A config.json that is missing a field, has a wrong type, or is inconsistent."""


@dataclass(frozen=True)
class DeepseekV41Config:
    vocab_size: int = 129280
    hidden_size: int = 5120
    num_hidden_layers: int = 40
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1280
    qk_rope_head_dim: int = 64
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    max_position_embeddings: int = 1048576
    sliding_window: int = 128
    compress_ratios: tuple[int, ...] | None = None
    kv_source_layer_ids: tuple[int, ...] | None = None
    index_source_layer_ids: tuple[int, ...] | None = None
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    o_groups: int = 8
    o_lora_rank: int = 1024
    moe_intermediate_size: int = 2304
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_vocab_size: int = 16000000
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 99092
    num_nextn_predict_layers: int = 3
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] | None = None
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-20
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = None
    quantization_config: dict | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "dspark_target_layer_ids",
                     "engram_layer_ids", "engram_num_embeddings"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
                    raise ConfigError(f"config field `{name}` must be a list of integers, got {value!r}")
                set_(self, name, tuple(value))
        if isinstance(self.eos_token_id, list):
            set_(self, "eos_token_id", tuple(self.eos_token_id))
        self._check_sizes()
        self._check_values()
        n, n_nextn = self.num_hidden_layers, self.num_nextn_predict_layers

        ratios = self.compress_ratios
        if ratios is None:
            if n == len(_DEFAULT_RATIOS):
                ratios = _DEFAULT_RATIOS
            else:
                n_slide = min(2, n)
                n_enc = max(0, (n - n_slide + 1) // 2)
                ratios = (0,) * n_slide + (2,) * n_enc + (1,) * max(0, n - n_slide - n_enc)
        if len(ratios) < n:
            raise ConfigError(f"`compress_ratios` needs at least num_hidden_layers ({n}) entries, got {len(ratios)}")
        if len(ratios) > n + n_nextn:
            raise ConfigError(f"`compress_ratios` has {len(ratios)} entries but the model has {n + n_nextn} layers")
        if any(r < 0 for r in ratios):
            raise ConfigError(f"`compress_ratios` entries must be >= 0, got {list(ratios)}")
        ratios = tuple(ratios[:n]) + tuple(ratios[n:]) + (0,) * (n_nextn - max(0, len(ratios) - n))
        set_(self, "compress_ratios", ratios)
        backbone = ratios[:n]

        kv_sources = self.kv_source_layer_ids
        if kv_sources is None:
            if backbone == _DEFAULT_RATIOS[:n] and n == len(_DEFAULT_RATIOS):
                kv_sources = _DEFAULT_KV_SOURCES
            else:
                kv_sources = tuple(i for i in range(n) if backbone[i] > 0 and (i == 0 or backbone[i - 1] != backbone[i]))
            set_(self, "kv_source_layer_ids", kv_sources)
        if self.index_source_layer_ids is None:
            index = _DEFAULT_INDEX_SOURCES if kv_sources == _DEFAULT_KV_SOURCES else kv_sources
            set_(self, "index_source_layer_ids", tuple(index))
        if self.dspark_target_layer_ids is None:
            set_(self, "dspark_target_layer_ids", tuple(sorted([i for i in range(n) if i not in kv_sources][-3:])))
        self._check_schedule(backbone)
        if any(not 0 <= i < n for i in self.dspark_target_layer_ids):
            raise ConfigError(f"`dspark_target_layer_ids` {list(self.dspark_target_layer_ids)} out of range [0, {n})")
        if self.candidate_source_layer_id is None:
            set_(self, "candidate_source_layer_id", kv_sources[-1] if kv_sources else -1)
        c = self.candidate_source_layer_id
        if c >= 0 and c not in self.index_source_layer_ids:
            raise ConfigError(f"`candidate_source_layer_id` ({c}) must be one of index_source_layer_ids "
                              f"{list(self.index_source_layer_ids)}")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError(f"`engram_num_embeddings` has {len(self.engram_num_embeddings)} entries but "
                              f"`engram_layer_ids` has {len(self.engram_layer_ids)}")
        if any(not 0 <= i < n for i in self.engram_layer_ids):
            raise ConfigError(f"`engram_layer_ids` {list(self.engram_layer_ids)} out of range [0, {n})")
        set_(self, "rope_parameters", self._resolve_rope())

    def _check_sizes(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank",
                    "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "o_groups", "o_lora_rank",
                    "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult",
                    "candidate_topk_blocks", "candidate_block_size", "hc_sinkhorn_iters")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field `{name}` must be a positive integer, got {value!r}")
        if not isinstance(self.num_nextn_predict_layers, int) or self.num_nextn_predict_layers < 0:
            raise ConfigError(f"config field `num_nextn_predict_layers` must be a non-negative integer, got "
                              f"{self.num_nextn_predict_layers!r}")
        for name in ("norm_topk_prob", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field `{name}` must be true or false, got {getattr(self, name)!r}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"`num_experts_per_tok` ({self.num_experts_per_tok}) exceeds `n_routed_experts` "
                              f"({self.n_routed_experts})")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"`num_attention_heads` ({self.num_attention_heads}) is not a multiple of `o_groups` "
                              f"({self.o_groups})")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            raise ConfigError(f"`qk_rope_head_dim` ({self.qk_rope_head_dim}) must be even and at most head_dim "
                              f"({self.head_dim})")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(f"`index_head_dim` ({self.index_head_dim}) is smaller than qk_rope_head_dim "
                              f"({self.qk_rope_head_dim})")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ConfigError(f"`scoring_func` {self.scoring_func!r} is not one of sqrtsoftplus, softmax, sigmoid")
        if self.hidden_act != "silu":
            raise ConfigError(f"`hidden_act` {self.hidden_act!r} is not supported (only 'silu')")

    def _check_values(self) -> None:
        """Numbers that must be positive and finite, and token ids that must be ids."""
        for name in _POSITIVE_NUMBERS:
            value = getattr(self, name)
            if not _is_number(value, "float") or value <= 0:
                raise ConfigError(f"config field `{name}` must be a finite number > 0, got {value!r}")
        for name in ("max_position_embeddings", "dspark_block_size", "engram_n_heads", "engram_head_dim",
                     "engram_vocab_size", "dspark_markov_rank", "dspark_n_routed_experts",
                     "dspark_num_experts_per_tok"):
            value = getattr(self, name)
            if not _is_number(value, "int") or value < 1:
                raise ConfigError(f"config field `{name}` must be a positive integer, got {value!r}")
        if not _is_number(self.n_shared_experts, "int") or self.n_shared_experts < 0:
            raise ConfigError(f"config field `n_shared_experts` must be an integer >= 0, got {self.n_shared_experts!r}")
        if self.engram_layer_ids and (not _is_number(self.engram_max_ngram_size, "int")
                                      or self.engram_max_ngram_size < 2):
            raise ConfigError(f"config field `engram_max_ngram_size` must be an integer >= 2 (n-grams of 2 or more "
                              f"tokens), got {self.engram_max_ngram_size!r}")
        for name in ("bos_token_id", "pad_token_id", "engram_pad_id"):
            value = getattr(self, name)
            if value is not None and (not _is_number(value, "int") or value < 0):
                raise ConfigError(f"config field `{name}` must be a token id (an integer >= 0), got {value!r}")
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        if self.eos_token_id is not None and not all(_is_number(t, "int") and t >= 0 for t in eos):
            raise ConfigError(f"config field `eos_token_id` must be a token id or a list of token ids, "
                              f"got {self.eos_token_id!r}")
        noise = self.dspark_noise_token_id
        if self.num_nextn_predict_layers and (not _is_number(noise, "int") or not 0 <= noise < self.vocab_size):
            raise ConfigError(f"config field `dspark_noise_token_id` must be an id in [0, vocab_size="
                              f"{self.vocab_size}), got {noise!r}")
        if self.dspark_num_experts_per_tok > self.dspark_n_routed_experts:
            raise ConfigError(f"`dspark_num_experts_per_tok` ({self.dspark_num_experts_per_tok}) exceeds "
                              f"`dspark_n_routed_experts` ({self.dspark_n_routed_experts})")

    def _check_schedule(self, backbone: tuple[int, ...]) -> None:
        n = self.num_hidden_layers
        kv, index = self.kv_source_layer_ids, self.index_source_layer_ids
        if any(not 0 <= i < n for i in kv) or any(backbone[i] == 0 for i in kv):
            raise ConfigError(f"`kv_source_layer_ids` {list(kv)} must be layers in [0, {n}) with compress_ratios > 0")
        if any(not 0 <= i < n for i in index) or any(backbone[i] == 0 for i in index):
            raise ConfigError(f"`index_source_layer_ids` {list(index)} must be layers in [0, {n}) with "
                              "compress_ratios > 0")
        if any(i not in kv and not any(s < i for s in kv) for i in index):
            raise ConfigError(f"every index source {list(index)} needs a KV source at or before it {list(kv)}")
        for i in range(n):
            if backbone[i] > 0 and not any(s <= i for s in kv):
                raise ConfigError(f"layer {i} has compress ratio {backbone[i]} but no KV source at or before it")
            if backbone[i] > 0 and backbone[i] != backbone[self.kv_source_of(i)]:
                raise ConfigError(f"layer {i} has compress ratio {backbone[i]} but its KV source "
                                  f"{self.kv_source_of(i)} has ratio {backbone[self.kv_source_of(i)]}")

    def _resolve_rope(self) -> dict:
        rp = self.rope_parameters or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main, compress = dict(rp["main"]), dict(rp["compress"])
        else:
            partial = self.qk_rope_head_dim / self.head_dim
            yarn = {k: v for k, v in (self.rope_scaling or {}).items() if k not in ("main", "compress", "type")}
            if "type" in (self.rope_scaling or {}) and "rope_type" not in yarn:
                yarn["rope_type"] = self.rope_scaling["type"]
            main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": partial}
            compress = {**yarn, "rope_theta": self.compress_rope_theta, "partial_rotary_factor": partial}
            compress.setdefault("rope_type", "default")
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)
        for name, params in (("main", main), ("compress", compress)):
            kind = params.get("rope_type", "default")
            if kind not in ("default", "yarn"):
                raise ConfigError(f"rope `{name}`: rope_type {kind!r} is not supported (default or yarn)")
            if kind == "yarn" and ("factor" not in params or "original_max_position_embeddings" not in params):
                raise ConfigError(f"rope `{name}`: yarn needs `factor` and `original_max_position_embeddings`")
            for key in ("rope_theta", "factor", "original_max_position_embeddings", "partial_rotary_factor"):
                if key in params and (not _is_number(params[key], "float") or params[key] <= 0):
                    raise ConfigError(f"rope `{name}`: `{key}` must be a finite number > 0, got {params[key]!r}")
            for key in ("beta_fast", "beta_slow", "attention_factor"):
                if key in params and not _is_number(params[key], "float"):
                    raise ConfigError(f"rope `{name}`: `{key}` must be a finite number, got {params[key]!r}")
            if int(self.head_dim * params.get("partial_rotary_factor", 1.0)) != self.qk_rope_head_dim:
                raise ConfigError(f"rope `{name}`: partial_rotary_factor gives "
                                  f"{int(self.head_dim * params.get('partial_rotary_factor', 1.0))} rotated dims, "
                                  f"but qk_rope_head_dim is {self.qk_rope_head_dim}")
        return {"main": main, "compress": compress}

    # --- the schedule, as the model reads it -------------------------------------------------------------------

    def kv_source_of(self, layer: int) -> int:
        """The KV-source layer whose compressed cache `layer` reads: the nearest source at or before it."""
        return max(s for s in self.kv_source_layer_ids if s <= layer)

    def layer_kind(self, layer: int) -> str:
        """'window' (ratio 0), 'encoder' (ratio > 1) or 'decoder' (ratio 1)."""
        ratio = self.compress_ratios[layer]
        return "window" if ratio == 0 else ("decoder" if ratio == 1 else "encoder")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @property
    def mix_hc(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def engram_n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    # --- (de)serialisation -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV41Config:
        """Build from a `config.json` dict, flat or with the text model under `text_config`."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config must be a JSON object, got {type(raw).__name__}")
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise ConfigError("config field `text_config` must be a JSON object")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in names}
        quant = raw.get("quantization_config", text.get("quantization_config"))
        if quant is not None and not isinstance(quant, dict):
            raise ConfigError("config field `quantization_config` must be a JSON object")
        kwargs["quantization_config"] = quant
        for f in dataclasses.fields(cls):
            if f.name in kwargs and f.type in ("int", "float") and not _is_number(kwargs[f.name], f.type):
                raise ConfigError(f"config field `{f.name}` must be {'an integer' if f.type == 'int' else 'a number'}"
                                  f", got {kwargs[f.name]!r}")
        missing = [name for name in SHAPE_FIELDS if name not in kwargs]
        nor = f" (nor {', '.join(missing[1:])})" if missing[1:] else ""
        absent = f"config has no `{missing[0]}`{nor}: the weights' shapes depend on it" if missing else ""
        try:
            config = cls(**kwargs)
        except ConfigError as e:  # perhaps because the released model's value stood in for a missing field
            raise ConfigError(f"{e}; {absent}" if missing else str(e)) from None
        if missing:
            raise ConfigError(f"{absent}, so a config.json must give it")
        return config

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> DeepseekV41Config:
        """Read `config.json` from a model directory (or the file itself)."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
        if not os.path.exists(file):
            raise ConfigError(f"no config.json in {os.fspath(path)!r}")
        try:
            with open(file, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> DeepseekV41Config:
        """A copy with `changes`. A new layer count derives the schedule afresh unless the change gives it."""
        if "num_hidden_layers" in changes:
            for name in _SCHEDULE_FIELDS:
                changes.setdefault(name, None)
        elif "num_nextn_predict_layers" in changes:  # the draft layers' entries (always 0) follow the new count
            changes.setdefault("compress_ratios", self.compress_ratios[: self.num_hidden_layers])
        return dataclasses.replace(self, **changes)


def _is_number(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return False
    if kind == "int":
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)
