"""DeepSeek-V4.1-Flash, declared in the DSL.

`DeepseekV41Flash` holds a config and its weights; `.graph()` declares the text model as a DSL graph over the
flat token dim N. The per-layer schedule (window-only, encoder and decoder layers, KV sources, index sources,
the candidate source, Engram layers) comes from the config, which derives it as the reference does.
"""

from __future__ import annotations

import os

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.models.engram_layout import compressed_token_map, engram_layers
from deepinfer.models.weights import ExpertShard
from deepinfer.replay import boundary_layer
from dsl.builder import GraphBuilder
from dsl.graph import Graph, Value
from dsl.ops.rope import rope_params
from dsl.quant import scale_to_float
from dsl.tensor import num_tokens

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
                torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "uint8", torch.int8: "int8", torch.int64: "int64"}


class DeepseekV41Flash:
    """The V4.1-Flash text model: config, weights (canonical checkpoint names) and its DSL declaration."""

    def __init__(self, config: DeepseekV41Config, weights: dict[str, torch.Tensor], model_dir: str | None = None,
                 tokenizer=None, shard: ExpertShard | None = None) -> None:
        self.config = config
        self.weights = weights
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.shard = shard  # one rank's share of the routed experts (expert parallelism); None: all of them
        self._params: dict[str, torch.Tensor] | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, shard: ExpertShard | None = None,
                        progress: bool = False) -> DeepseekV41Flash:
        """Load `config.json` and the safetensors weights of a model directory (memory-mapped); with `shard`, of the
        routed experts only that rank's; `progress`: under a progress bar."""
        from deepinfer.checkpoint import load_checkpoint

        config = DeepseekV41Config.from_pretrained(path)
        return cls(config, load_checkpoint(path, config, shard, progress), model_dir=os.fspath(path), shard=shard)

    def graph(self, dspark: bool = False, replay: bool = False) -> Graph:
        """The text model as a DSL graph: `input_ids` [N] -> `logits` [rows, vocab] (fp32).

        With `dspark` it also writes every token's DSpark main keys into the draft layers' windows and outputs
        them as `draft_keys` [N, draft layers, head_dim]. With `replay` (bounded replay, deepinfer/replay.py) the
        decoder layers run over the rows of each sequence from its `replay_from` on: the boundary layer's
        compressor first runs over every row, then `replay_rows` and `decoder_context` (dsl/ops/replay.py) take the
        streams, the DSpark features so far and the context to those rows.
        """
        return _Declaration(self.config, self.params()).build(dspark, replay)

    def draft_graph(self) -> Graph:
        """The DSpark draft layers as a DSL graph over blocks, one block per chunk of the forward: `input_ids` [N]
        (each block's last accepted token, then noise tokens) -> `hidden` [N, hidden] (the collapsed streams,
        before the output norm) and `logits` [N, vocab] (fp32, without the Markov term; deepinfer/dspark.py).
        A block attends to the `sliding_window` main keys before its first position and to all of itself."""
        if not self.config.num_nextn_predict_layers:
            raise ValueError("this model has no DSpark draft layers (num_nextn_predict_layers is 0)")
        return _Declaration(self.config, self.params()).build_drafts()

    def params(self) -> dict[str, torch.Tensor]:
        """The graph's parameters: checkpoint weights plus what the declaration derives from them (stacked
        experts, of this rank's share when `shard` is set; Engram's compressed token map, the one-hot first
        collapse). Computed once."""
        if self._params is not None:
            return self._params
        params = dict(self.weights)
        cfg = self.config
        params["hc_stream0"] = torch.nn.functional.one_hot(torch.tensor(0), cfg.hc_mult).float()
        blocks = [f"layers.{i}" for i in range(cfg.num_hidden_layers)]
        blocks += [f"mtp.{i}" for i in range(cfg.num_nextn_predict_layers)]
        for block in blocks:
            prefix = f"{block}.ffn.experts"
            count = cfg.n_routed_experts if block.startswith("layers") else cfg.dspark_n_routed_experts
            held = range(count) if self.shard is None else self.shard.experts(count)
            for w in ("w1", "w2", "w3"):
                for kind in ("weight", "scale"):
                    names = [f"{prefix}.{j}.{w}.{kind}" for j in held]
                    if names[0] in params:
                        params[f"{prefix}.{w}.{kind}"] = torch.stack([_uniform(params.pop(n)) for n in names])
        if cfg.engram_layer_ids:
            params["engram.token_map"] = self.engram_token_map()
        self._params = params
        return params

    def engram_token_map(self) -> torch.Tensor:
        if self.tokenizer is None:
            from deepinfer.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.model_dir)
        tokenizer = self.tokenizer
        token_map, size = compressed_token_map(tokenizer.backend)
        if size != self.config.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer's compressed vocabulary has {size} entries but the config's "
                             f"engram_compressed_vocab_size is {self.config.engram_compressed_vocab_size}: the "
                             "Engram hashes would not match the tables")
        return token_map


def _uniform(t: torch.Tensor) -> torch.Tensor:
    """One storage per role, so experts stack: scales as fp32 (ue8m0 bytes decoded), packed fp4 as uint8."""
    if t.dtype == torch.float8_e8m0fnu:
        return scale_to_float(t)
    return t.view(torch.uint8) if t.dtype == torch.int8 else t


class _Declaration:
    """Builds the graph layer by layer; holds the values that flow between layers (the shared KV state)."""

    def __init__(self, config: DeepseekV41Config, params: dict[str, torch.Tensor]) -> None:
        self.cfg = config
        self.weights = params
        self.b = GraphBuilder()
        self.compressed: Value | None = None  # the current KV source's compressed cache view
        self.index_keys: Value | None = None  # the current indexer keys
        self.topk: Value | None = None  # the latest index source's selection
        self.candidates: Value | None = None
        self.compressed_early: int | None = None  # the boundary layer, whose compressor ran before the boundary

    def p(self, name: str) -> Value:
        t = self.weights.get(name)
        if t is None:
            raise KeyError(f"weight {name!r} is missing")
        return self.b.param(name, tuple(t.shape), _DTYPE_NAMES.get(t.dtype, str(t.dtype)))

    def scale(self, module: str) -> Value | None:
        return self.p(f"{module}.scale") if f"{module}.scale" in self.weights else None

    def linear(self, x: Value, module: str) -> Value:
        return self.b.linear(x, self.p(f"{module}.weight"), self.scale(module))

    def build(self, dspark: bool = False, replay: bool = False) -> Graph:
        cfg, b = self.cfg, self.b
        boundary = boundary_layer(cfg) if replay else None
        ids = b.input("input_ids", (num_tokens,), "int64")
        h = b.broadcast_streams(b.embedding(ids, self.p("embed.weight")), copies=cfg.hc_mult)
        ngrams = None
        if cfg.engram_layer_ids:
            token_map = self.weights["engram.token_map"]
            pad = int(token_map[cfg.engram_pad_id])
            ngrams = b.engram_ngrams(ids, self.p("engram.token_map"), n=cfg.engram_max_ngram_size, pad_id=pad)
        engram = engram_layers(cfg)
        pre, features = self.p("hc_stream0"), []
        for layer in range(cfg.num_hidden_layers):
            if layer in engram:
                h = self.engram(h, ngrams, layer, engram[layer])
            if layer == boundary:
                pre, features = self.replay_boundary(h, pre, features, layer)
                h = b.replay_rows(h, window=cfg.sliding_window)
                b.decoder_context(window=cfg.sliding_window)
            if layer in cfg.dspark_target_layer_ids:
                features.append(b.hc_mean(h))  # the streams entering the layer's attention
            h, pre = self.block(h, pre, f"layers.{layer}", lambda x, layer=layer: self.attention(x, layer))
        x = b.rms_norm(b.hc_collapse(h, pre), self.p("norm.weight"), eps=cfg.rms_norm_eps)
        b.output("logits", b.linear(b.select_rows(x), self.p("head.weight"), self.scale("head")))
        if dspark:
            self.main_keys(features)
        return b.graph

    def replay_boundary(self, h: Value, pre: Value, features: list[Value], layer: int) -> tuple[Value, list[Value]]:
        """Before the boundary: the boundary layer's compressor over every row, from the attention input it has in the
        exact forward; then the per-token values the decoder layers read (the collapse weights, DSpark features,
        index picks and candidates so far), each taken to the decoder rows."""
        b, cfg = self.b, self.cfg
        x = b.rms_norm(b.hc_collapse(h, pre), self.p(f"layers.{layer}.attn_norm.weight"), eps=cfg.rms_norm_eps)
        self.compress(x, layer, self.rope(layer))
        self.compressed_early = layer

        def rows(v: Value) -> Value:
            return b.replay_rows(v, window=cfg.sliding_window)
        self.topk = None if self.topk is None else rows(self.topk)
        self.candidates = None if self.candidates is None else rows(self.candidates)
        return (pre if layer == 0 else rows(pre)), [rows(f) for f in features]

    def rope(self, layer: int) -> dict:
        """Layer `layer`'s rope: `compress` for compressed layers, `main` for window-only ones."""
        name = "compress" if self.cfg.compress_ratios[layer] else "main"
        return {"params": rope_params(self.cfg.rope_parameters[name]), "rope_dim": self.cfg.qk_rope_head_dim}

    def main_keys(self, features: list[Value]) -> None:
        """DSpark's main keys: the target layers' features projected (`main_proj`, `main_norm`), then per draft
        layer through its `wkv` and `kv_norm`, main rope at the token's position and fp8, into its window."""
        b, cfg, eps = self.b, self.cfg, self.cfg.rms_norm_eps
        main = b.rms_norm(self.linear(b.concat(*features), "mtp.0.main_proj"), self.p("mtp.0.main_norm.weight"),
                          eps=eps)
        keys = []
        for i in range(cfg.num_nextn_predict_layers):
            name = f"mtp.{i}.attn"
            kv = b.rms_norm(self.linear(main, f"{name}.wkv"), self.p(f"{name}.kv_norm.weight"), eps=eps)
            kv = b.fp8_round(b.rope(kv, **self.main_rope()), block=32)
            b.kv_window_store(kv, layer=cfg.num_hidden_layers + i, window=cfg.sliding_window + 1)
            keys.append(kv)
        b.output("draft_keys", b.stack(*keys))

    def build_drafts(self) -> Graph:
        cfg, b = self.cfg, self.b
        ids = b.input("input_ids", (num_tokens,), "int64")
        h = b.broadcast_streams(b.embedding(ids, self.p("embed.weight")), copies=cfg.hc_mult)
        pre = self.p("hc_stream0")
        for i in range(cfg.num_nextn_predict_layers):
            h, pre = self.block(h, pre, f"mtp.{i}", lambda x, i=i: self.draft_attention(x, i))
        hidden = b.hc_collapse(h, pre)
        last = f"mtp.{cfg.num_nextn_predict_layers - 1}"
        x = b.rms_norm(hidden, self.p(f"{last}.norm.weight"), eps=cfg.rms_norm_eps)
        b.output("hidden", hidden)
        b.output("logits", b.linear(x, self.p("head.weight"), self.scale("head")))
        return b.graph

    def main_rope(self) -> dict:
        return {"params": rope_params(self.cfg.rope_parameters["main"]), "rope_dim": self.cfg.qk_rope_head_dim}

    def draft_attention(self, x: Value, i: int) -> Value:
        """A draft layer's attention: its block's queries over the window of main keys before the block and the
        block's own keys (not stored), all visible to all."""
        b, cfg, name = self.b, self.cfg, f"mtp.{i}.attn"
        q, kv = self.qkv(x, name, self.main_rope())
        window = b.kv_window_block(kv, layer=cfg.num_hidden_layers + i, window=cfg.sliding_window + 1)
        o = b.sparse_attention(q, window, self.p(f"{name}.attn_sink"), window_size=cfg.sliding_window + 1,
                               scale=cfg.head_dim**-0.5, causal=False)
        return self.output_projection(o, name, self.main_rope())

    def block(self, h: Value, pre: Value, name: str, attention) -> tuple[Value, Value]:
        """One layer: attention then MoE, each between hyper-connection mixes. Returns (streams, FFN pre)."""
        b, cfg = self.b, self.cfg

        def mixes(h: Value, site: str) -> tuple[Value, Value, Value]:
            return b.hc_mixes(h, self.p(f"{name}.hc_{site}_fn"), self.p(f"{name}.hc_{site}_scale"),
                              self.p(f"{name}.hc_{site}_base"), iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps,
                              norm_eps=cfg.rms_norm_eps)

        attn_pre, post, comb = mixes(h, "attn")
        x = b.rms_norm(b.hc_collapse(h, pre), self.p(f"{name}.attn_norm.weight"), eps=cfg.rms_norm_eps)
        h = b.hc_expand(attention(x), h, post, comb)
        ffn_pre, post, comb = mixes(h, "ffn")
        x = b.rms_norm(b.hc_collapse(h, attn_pre), self.p(f"{name}.ffn_norm.weight"), eps=cfg.rms_norm_eps)
        h = b.hc_expand(self.moe(x, name), h, post, comb)
        return h, ffn_pre

    def attention(self, x: Value, layer: int) -> Value:
        b, cfg, name = self.b, self.cfg, f"layers.{layer}.attn"
        ratio, rope = cfg.compress_ratios[layer], self.rope(layer)
        q, kv, qr = self.qkv(x, name, rope, with_qr=True)
        window = b.kv_window_append(kv, layer=layer, window=cfg.sliding_window)
        compressed = topk = None
        if ratio:
            if layer in cfg.kv_source_layer_ids and layer != self.compressed_early:
                self.compress(x, layer, rope)
            if layer in cfg.index_source_layer_ids:
                self.select(x, qr, layer, rope)
            compressed, topk = self.compressed, self.topk
        o = b.sparse_attention(q, window, self.p(f"{name}.attn_sink"), compressed, topk,
                               window_size=cfg.sliding_window, scale=cfg.head_dim**-0.5)
        return self.output_projection(o, name, rope)

    def qkv(self, x: Value, name: str, rope: dict, with_qr: bool = False) -> tuple[Value, ...]:
        """Queries [N, heads, head_dim] and the K=V latent [N, head_dim] (roped, fp8-rounded) of attention `name`;
        also the normed query latent with `with_qr` (the indexer reads it)."""
        b, cfg, eps = self.b, self.cfg, self.cfg.rms_norm_eps
        qr = b.rms_norm(self.linear(x, f"{name}.wq_a"), self.p(f"{name}.q_norm.weight"), eps=eps)
        q = b.rope(b.reshape(self.linear(qr, f"{name}.wq_b"), shape=(cfg.num_attention_heads, cfg.head_dim)), **rope)
        kv = b.rms_norm(self.linear(x, f"{name}.wkv"), self.p(f"{name}.kv_norm.weight"), eps=eps)
        kv = b.fp8_round(b.rope(kv, **rope), block=32)
        return (q, kv, qr) if with_qr else (q, kv)

    def output_projection(self, o: Value, name: str, rope: dict) -> Value:
        """Attention output [N, heads, head_dim]: inverse rope, then `wo_a` per group and `wo_b`."""
        b, cfg = self.b, self.cfg
        o = b.reshape(b.rope(o, inverse=True, **rope), shape=(cfg.num_attention_heads * cfg.head_dim,))
        o = b.grouped_linear(o, self.p(f"{name}.wo_a.weight"), self.scale(f"{name}.wo_a"), groups=cfg.o_groups)
        return self.linear(o, f"{name}.wo_b")

    def compress(self, x: Value, layer: int, rope: dict) -> None:
        """A KV source: pool new groups into entries, publish the compressed cache and (if indexing) its keys."""
        b, cfg, name = self.b, self.cfg, f"layers.{layer}.attn"
        ratio, eps = cfg.compress_ratios[layer], cfg.rms_norm_eps
        gate = self.linear(x, f"{name}.compressor.wgate") if ratio > 1 else None
        latent = b.compress_pool(self.linear(x, f"{name}.compressor.wkv"), gate, layer=layer, ratio=ratio)
        latent = b.rms_norm(latent, self.p(f"{name}.compressor.norm.weight"), eps=eps)
        if layer in cfg.index_source_layer_ids:
            keys = b.rms_norm(self.linear(latent, f"{name}.indexer.wk"), self.p(f"{name}.indexer.k_norm.weight"),
                              eps=eps)
            keys = b.fp4_round(b.rope_entries(keys, ratio=ratio, **rope), block=32, e4m3_scale=False)
            self.index_keys = b.cache_append(keys, layer=layer, name="index")
        entries = b.fp4_round(b.rope_entries(latent, ratio=ratio, **rope), block=16, e4m3_scale=True)
        self.compressed = b.cache_append(entries, layer=layer, name="kv")

    def select(self, x: Value, qr: Value, layer: int, rope: dict) -> None:
        """An index source: score queries against the indexer keys and pick the top entries."""
        b, cfg, name = self.b, self.cfg, f"layers.{layer}.attn.indexer"
        ratio = cfg.compress_ratios[layer]
        q = b.reshape(self.linear(qr, f"{name}.wq_b"), shape=(cfg.index_n_heads, cfg.index_head_dim))
        q = b.fp4_round(b.rope(q, **rope), block=32, e4m3_scale=False)
        scores = b.index_scores(q, self.linear(x, f"{name}.weights_proj"), self.index_keys, ratio=ratio)
        candidates = None
        if layer == cfg.candidate_source_layer_id:
            self.candidates = b.candidate_blocks(scores, ratio=ratio, block=cfg.candidate_block_size,
                                                 topk_blocks=cfg.candidate_topk_blocks)
        elif 0 <= cfg.candidate_source_layer_id < layer:
            candidates = self.candidates
        self.topk = b.topk_select(scores, candidates, topk=cfg.index_topk)

    def moe(self, x: Value, block: str) -> Value:
        b, cfg, name = self.b, self.cfg, f"{block}.ffn"
        topk = cfg.dspark_num_experts_per_tok if block.startswith("mtp") else cfg.num_experts_per_tok
        weights, experts = b.moe_gate(x, self.p(f"{name}.gate.weight"), self.p(f"{name}.gate.bias"),
                                      topk=topk, func=cfg.scoring_func, temp=cfg.gate_temp,
                                      normalize=cfg.norm_topk_prob, scaling=cfg.routed_scaling_factor)
        stacked = [self.p(f"{name}.experts.{w}.weight") for w in ("w1", "w2", "w3")]
        scales = [self.scale(f"{name}.experts.{w}") for w in ("w1", "w2", "w3")]
        routed = b.moe_experts(x, weights, experts, *stacked, *scales, limit=cfg.swiglu_limit)
        shared = [self.p(f"{name}.shared_experts.{w}.weight") for w in ("w1", "w2", "w3")]
        shared_scales = [self.scale(f"{name}.shared_experts.{w}") for w in ("w1", "w2", "w3")]
        return b.add(routed, b.swiglu(x, *shared, *shared_scales, limit=cfg.swiglu_limit))

    def engram(self, h: Value, ngrams: Value, layer: int, constants) -> Value:
        b, cfg, name = self.b, self.cfg, f"layers.{layer}.engram"
        ids = b.engram_hash(ngrams, multipliers=constants.multipliers, primes=constants.primes,
                            offsets=constants.offsets)
        rows = b.engram_rows(ids, self.p(f"{name}.embed.weight"), self.scale(f"{name}.embed"))
        kv = self.linear(b.reshape(rows, shape=(cfg.engram_n_hash_cols * cfg.engram_head_dim,)), f"{name}.wkv")
        return b.engram_gate(h, kv, self.p(f"{name}.q_weight"), self.p(f"{name}.k_weight"), eps=cfg.rms_norm_eps)
