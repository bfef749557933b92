"""Engram's fused hash and table gather (kernels/engram/hash_rows.py) bitwise against `dsl.ops.engram`'s engram_hash
then engram_rows: float and fp8 tables, n-grams of 2 to 4 ids, several heads, any int64 ids; a token's rows alone and
among others; the fusion pass and the plan that serve it; V4.1-Flash's hashing constants and sizes on the GPU."""

from __future__ import annotations

import pytest
import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.models.engram_layout import EngramLayer, engram_layers
from dsl.builder import GraphBuilder
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from dsl.ops import engram as ref
from dsl.passes import run_passes
from dsl.quant import quantize_fp8_group
from dsl.tensor import num_tokens
from graphs.executor import Executor
from graphs.passes import make_plan
from kernels.engram.hash_rows import engram_hash_rows
from tests.kernels.cases import gen

V41 = DeepseekV41Config()  # V4.1-Flash's Engram: 2- to 4-grams, 8 heads of 256, compressed vocabulary of 99092
VOCAB = V41.engram_compressed_vocab_size


def layer_constants(n: int, heads: int, vocab: int, layer: int = 1) -> EngramLayer:
    """One layer's multipliers, primes (drawn above `vocab`) and offsets, by the model's recipe."""
    config = DeepseekV41Config(engram_layer_ids=(layer,), engram_num_embeddings=(0,), engram_vocab_size=vocab,
                               engram_max_ngram_size=n, engram_n_heads=heads)
    return engram_layers(config)[layer]


def constants(c: EngramLayer) -> dict:
    return dict(multipliers=c.multipliers, primes=c.primes, offsets=c.offsets)


def table_rows(c: EngramLayer) -> int:
    return c.offsets[-1] + c.primes[-1][-1]


def make_table(kind: str, rows: int, d: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(table, scale): "fp32" or "bf16" values, "fp8" codes with their per-32 scales, "fp8 codes" without them."""
    values = gen(rows, d, device=device, seed=seed, scale=3.0)
    if kind.startswith("fp8"):
        codes, scale = quantize_fp8_group(values)
        return codes, scale if kind == "fp8" else None
    return values.to(torch.bfloat16 if kind == "bf16" else torch.float32), None


def ngram_ids(tokens: int, n: int, device: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (tokens, n), generator=g).to(device)


def reference(ngrams: torch.Tensor, table: torch.Tensor, scale: torch.Tensor | None, c: EngramLayer) -> torch.Tensor:
    return ref.engram_rows(ref.engram_hash(ngrams, **constants(c)), table, scale)


@pytest.mark.parametrize("n,heads,d,tokens,block_m,kind", [
    (2, 3, 64, 5, 4, "fp8"),
    (3, 2, 40, 7, 4, "fp8"),  # a partial scale group
    (4, 3, 32, 9, 8, "fp8"),
    (4, 2, 40, 3, 2, "fp32"),
    (3, 4, 32, 6, 4, "bf16"),
    (2, 2, 48, 5, 1, "fp8 codes"),
])
def test_rows_match_the_hash_then_the_gather(n, heads, d, tokens, block_m, kind, device) -> None:
    c = layer_constants(n, heads, vocab=40 + 10 * n)
    table, scale = make_table(kind, table_rows(c) + 3, d, device, seed=n)
    ngrams = ngram_ids(tokens, n, device, seed=tokens)
    got = engram_hash_rows(ngrams, table, scale, **constants(c), config={"block_M": block_m, "num_warps": 4})
    want = reference(ngrams, table, scale, c)
    assert got.shape == want.shape == (tokens, (n - 1) * heads, d) and got.dtype == torch.float32
    assert torch.equal(got, want)


def test_any_int64_ids_hash_as_in_torch(device) -> None:
    """Negative ids and products that overflow int64: the same wrapped arithmetic and torch's remainder (the
    divisor's sign), where Triton's `%` on the GPU takes the dividend's."""
    c = layer_constants(4, 2, vocab=60)
    table, scale = make_table("fp8", table_rows(c), 32, device)
    g = torch.Generator().manual_seed(3)
    ngrams = torch.randint(-(2**63), 2**63 - 1, (16, 4), generator=g).to(device)
    ngrams[0] = torch.tensor([-1, -(2**63), 2**63 - 1, VOCAB])
    assert torch.equal(engram_hash_rows(ngrams, table, scale, **constants(c)), reference(ngrams, table, scale, c))


def test_a_tokens_rows_are_the_same_alone_and_among_others(device) -> None:
    c = layer_constants(3, 2, vocab=50)
    table, scale = make_table("fp8", table_rows(c), 64, device)
    ngrams = ngram_ids(9, 3, device, seed=4)
    config = {"block_M": 4, "num_warps": 4}
    batch = engram_hash_rows(ngrams, table, scale, **constants(c), config=config)
    for i in (0, 5, 8):
        assert torch.equal(engram_hash_rows(ngrams[i:i + 1].contiguous(), table, scale, **constants(c))[0], batch[i])
    order = torch.randperm(9, generator=torch.Generator().manual_seed(0)).to(device)
    moved = engram_hash_rows(ngrams[order].contiguous(), table, scale, **constants(c), config=config)
    assert torch.equal(moved, batch[order])


def test_bad_arguments_name_the_argument(device) -> None:
    c = layer_constants(3, 2, vocab=50)
    rows = table_rows(c)
    table, scale = make_table("fp8", rows, 64, device)
    ngrams = ngram_ids(4, 3, device)
    with pytest.raises(ValueError, match="ngrams"):
        engram_hash_rows(ngrams.int(), table, scale, **constants(c))
    with pytest.raises(ValueError, match=f"table has {rows - 1} rows; the hash reaches row {rows - 1}"):
        engram_hash_rows(ngrams, table[:-1], scale[:-1], **constants(c))
    with pytest.raises(ValueError, match="scale goes with an fp8 table"):
        engram_hash_rows(ngrams, table.float(), scale, **constants(c))
    with pytest.raises(ValueError, match="scale"):
        engram_hash_rows(ngrams, table, scale[:, :1].contiguous(), **constants(c))
    with pytest.raises(ValueError, match="multipliers"):
        engram_hash_rows(ngrams[:, :2].contiguous(), table, scale, **constants(c))
    with pytest.raises(ValueError, match="offsets"):
        engram_hash_rows(ngrams, table, scale, **(constants(c) | {"offsets": c.offsets[:-1]}))
    assert engram_hash_rows(ngrams[:0], table, scale, **constants(c)).shape == (0, 4, 64)


def lookup_graph(c: EngramLayer, n: int, rows: int, d: int, scaled: bool, shared: bool = False):
    """engram_hash -> engram_rows over an n-gram input, as the model builds it; `shared`: the ids an output too."""
    b = GraphBuilder()
    ids = b.engram_hash(b.input("ngrams", (num_tokens, n), "int64"), **constants(c))
    scale = b.param("scale", (rows, -(-d // 32)), "float32") if scaled else None
    b.output("rows", b.engram_rows(ids, b.param("table", (rows, d), "float8_e4m3fn"), scale))
    if shared:
        b.output("ids", ids)
    return run_passes(b.graph)


@pytest.mark.parametrize("scaled", [True, False])
def test_the_fusion_pass_makes_the_lookup_one_op(scaled) -> None:
    c = layer_constants(3, 2, vocab=50)
    graph = lookup_graph(c, 3, table_rows(c), 32, scaled)
    assert [node.op for node in graph.nodes] == ["engram_hash_rows"]
    assert graph.nodes[0].attrs == constants(c) and graph.nodes[0].inputs[2] is (graph.params["scale"] if scaled
                                                                                  else None)
    shared = lookup_graph(c, 3, table_rows(c), 32, scaled, shared=True)
    assert [node.op for node in shared.nodes] == ["engram_hash", "engram_rows"]


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float8_e8m0fnu, None])
def test_the_plan_serves_the_lookup_with_the_kernel(scale_dtype) -> None:
    """The fused node's lowering against the cpu target's reference: an fp8 table with float or ue8m0 scales (made
    fp32 once), or its codes alone."""
    c = layer_constants(3, 3, vocab=50)
    rows, d = table_rows(c), 64
    graph = lookup_graph(c, 3, rows, d, scale_dtype is not None)
    table, scale = make_table("fp8", rows, d, "cpu")
    params = {"table": table} | ({"scale": scale.to(scale_dtype)} if scale_dtype else {})
    plan = make_plan(graph, params, "sm90", buckets=(16,))
    node = plan.kernel_nodes()[0]
    assert node.template == "engram_hash_rows" and node.static.fields() == {"n": 3, "rows": rows, "d": d,
                                                                            "dtype": "float8_e4m3fn",
                                                                            "scaled": scale_dtype is not None}
    inputs = {"ngrams": ngram_ids(11, 3, "cpu")}
    want = interpret(graph, inputs, params, ForwardContext([SequenceState()], [11]))["rows"]
    got = Executor(graph, plan, params, "cpu").run(inputs, ForwardContext([SequenceState()], [11]))["rows"]
    assert torch.equal(got, want)


@pytest.fixture(scope="module")
def v41_fp8_table():
    """V4.1-Flash's fp8 Engram table format at the rows its largest prime needs (about 16M rows, 4.1 GB: past 2^31
    bytes), random codes (no NaN) and power-of-two scales: the 98 GB tables of the real offsets do not fit a test."""
    layers = engram_layers(V41.replace(engram_layer_ids=(1, 14), engram_num_embeddings=(0, 0)))
    rows = max(p for c in layers.values() for row in c.primes for p in row)
    g = torch.Generator(device="cuda").manual_seed(0)
    codes = torch.randint(0, 0x7F, (rows, V41.engram_head_dim), generator=g, device="cuda", dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=g, device="cuda", dtype=torch.uint8) << 7
    exponents = torch.randint(-20, 0, (rows, V41.engram_head_dim // 32), generator=g, device="cuda")
    return layers, codes.view(torch.float8_e4m3fn), torch.ldexp(torch.ones(exponents.shape, device="cuda"), exponents)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [1, 14])
def test_v41_hashing_constants_on_the_gpu(layer, v41_fp8_table) -> None:
    """V4.1-Flash's layers 1 and 14 (4-grams, 8 heads, d 256): their multipliers and primes, the offsets dropped so
    the 24 columns share one fp8 table of the largest prime's rows; 1 token, a block's worth and more, a prefill."""
    layers, table, scale = v41_fp8_table
    c = layers[layer]
    c = EngramLayer(c.multipliers, c.primes, (0,) * len(c.offsets))
    for tokens in (1, 7, 64, 513, 8192):
        ngrams = ngram_ids(tokens, 4, "cuda", seed=tokens)
        got = engram_hash_rows(ngrams, table, scale, **constants(c))
        assert got.shape == (tokens, 24, 256)
        assert torch.equal(got, reference(ngrams, table, scale, c)), tokens


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_v41_sizes_with_offsets_on_the_gpu(kind) -> None:
    """V4.1-Flash's 4-grams, 8 heads and d 256 with layer 14's multipliers; primes above 100000 (2.4M rows) so the
    24 columns keep their offsets into one table."""
    c = layer_constants(V41.engram_max_ngram_size, V41.engram_n_heads, vocab=100_000, layer=14)
    table, scale = make_table(kind, table_rows(c), V41.engram_head_dim, "cuda")
    for tokens in (1, 64, 8192):
        ngrams = ngram_ids(tokens, 4, "cuda", seed=tokens)
        assert torch.equal(engram_hash_rows(ngrams, table, scale, **constants(c)), reference(ngrams, table, scale, c))
