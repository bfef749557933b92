"""Tuning: config spaces within hardware limits, the cache and its keys, rejection of wrong candidates, and the
committed H200 tuning file matching the kernels it was measured on."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from autotune import choose, get_configs
from autotune.cache import TUNED_DIR, TuningCache, cache_key, source_hash, template_hash
from autotune.tune import tune
from kernels.linear.lowering import LinearStatic
from kernels.moe.lowering import GateStatic
from kernels.registry import tunable
from kernels.targets import get_target

SMEM_LIMIT = get_target("sm90").smem_per_block

# the tunable templates and the modules whose kernels they tune
MODULES = {"linear": "linear.linear", "moe_gate": "linear.linear", "moe_experts": "moe.experts",
           "sparse_attention": "attention.sparse_attention", "hc_mixes": "hyper.hyper"}
LINEAR = LinearStatic(n=5120, k=8192, groups=1, fmt="fp8")


@pytest.mark.parametrize("bucket", [16, 64, 8192])
def test_linear_space_respects_shared_memory_and_fp8_blocks(bucket) -> None:
    configs = get_configs("linear", LINEAR, bucket)
    assert configs
    for c in configs:
        assert c["num_stages"] * c["block_K"] * (c["block_N"] + c["block_M"] * 4) <= SMEM_LIMIT
        assert c["block_N"] % 32 == 0 and c["block_K"] % 32 == 0
        assert c["split_k"] == 1 or LINEAR.k // c["split_k"] >= 2 * c["block_K"]


@pytest.mark.parametrize("bucket", [1, 64, 8192])
def test_gate_space_holds_fp32_tiles(bucket) -> None:
    """The MoE gate's projection (fp32 x and W, fp32 products): tiles within shared memory at four bytes a value,
    split-K only at decode buckets and only where each split keeps two K stages."""
    configs = get_configs("moe_gate", GateStatic(384, 5120), bucket)
    assert configs
    for c in configs:
        assert c["num_stages"] * c["block_K"] * (c["block_N"] + c["block_M"]) * 4 <= SMEM_LIMIT
        assert c["split_k"] == 1 or (bucket <= 64 and 5120 // c["split_k"] >= 2 * c["block_K"])
    assert bucket <= 64 or {c["block_K"] for c in configs} == {16, 32, 64}


def test_cache_round_trip_and_fallback(tmp_path) -> None:
    cache = TuningCache(tmp_path / "t.json")
    src, static = source_hash(importlib.import_module("kernels.linear.linear")), LINEAR.fields()
    key = cache_key("linear", static, 16, "sm90", "NVIDIA H200", src)
    assert choose("linear", static, 16, "sm90", src, lambda: {"h": 1}, cache) == ({"h": 1}, "heuristic")
    cache.put(key, {"block_N": 64}, 12.5)
    cache.save()
    again = TuningCache(tmp_path / "t.json")
    assert choose("linear", static, 16, "sm90", src, lambda: {"h": 1}, again) == ({"block_N": 64}, "tuned")
    # another device or an edited kernel misses
    assert choose("linear", static, 16, "sm90", src, lambda: {}, again, device="NVIDIA B200")[1] == "heuristic"
    assert choose("linear", static, 16, "sm90", "0" * 16, lambda: {}, again)[1] == "heuristic"


def test_tune_rejects_configs_whose_output_is_wrong() -> None:
    ref = torch.ones(4)
    best, trials = tune([{"a": 1}, {"a": 2}], lambda c: ref * c["a"] + 1, ref, tol=1e-3)
    assert best is None and all(t.us is None and "rel_l2" in t.error for t in trials)


def test_the_tuners_heuristic_is_the_plans_for_every_job() -> None:
    """The summary's "heur us" column times the config a plan runs untuned: for every job whose shapes a plan of the
    full sizes (4 layers, the checkpoint's formats, no tuning) has, the config of its node in that bucket."""
    from autotune.run import heuristic, load_config, select_work
    from deepinfer.config import DeepseekV41Config
    from dsl.passes import run_passes
    from graphs.passes import make_plan

    assert set(tunable()) == set(MODULES)
    buckets = (1, 16, 64, 512, 8192)
    work = select_work(load_config(None), tunable(), list(buckets))
    assert {t for t, _, _ in work} == set(MODULES)
    model = meta_checkpoint_model(DeepseekV41Config(num_hidden_layers=4))
    plan = make_plan(run_passes(model.graph()), model.params(), "sm90", buckets, tuning=TuningCache(None))
    planned = {(n.template, n.static, b): n.buckets[b].config for n in plan.kernel_nodes() for b in buckets}
    checked = [(t, st, b) for t, st, b in work if (t, st, b) in planned]
    assert {t for t, _, _ in checked} == set(MODULES)
    for template, st, bucket in checked:
        assert heuristic(template, st, bucket) == planned[template, st, bucket], (template, st, bucket)


def test_committed_h200_tuning_matches_the_kernels() -> None:
    """Every entry of autotune/tuned/sm90.json was measured on the kernels as they are: an edited kernel source
    needs `python -m autotune.run` on an H200 again (bench/run_gpu.sh with TUNE=1)."""
    entries = json.loads((TUNED_DIR / "sm90.json").read_text())["configs"]
    assert len(entries) >= 20
    for key in entries:
        template, _, _, target, device, src = key.split("|")
        module = importlib.import_module(f"kernels.{MODULES[template]}")
        assert (target, device) == ("sm90", "NVIDIA H200")
        # what plans look the configs up with: the hashes of every module whose kernels serve the template
        assert src == template_hash(template), f"{key}: the {template} kernels changed since they were tuned"
        assert src.startswith(source_hash(module))


# ---- `deepinfer autotune`: flags, the config's fields, the errors a user meets --------------------------------------

SMALL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 64, "q_lora_rank": 64,
         "qk_rope_head_dim": 16, "o_groups": 2, "o_lora_rank": 64, "n_routed_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 128, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16, "vocab_size": 1024,
         "sliding_window": 16, "compress_ratios": [0, 2, 1, 1], "kv_source_layer_ids": [1, 2],
         "index_source_layer_ids": [1, 2], "num_nextn_predict_layers": 0}


def write_config(tmp_path, fields: dict, nested: bool = False):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "deepseek_v41", "text_config": fields} if nested else fields))
    return path


def meta_checkpoint_model(config):
    """A DeepseekV41Flash whose weights are meta tensors in the real checkpoint's storage formats (fp8 32x32 blocks
    with fp32 scales, stacked fp4 experts): planning reads only shapes and dtypes."""
    from deepinfer.models import DeepseekV41Flash
    from deepinfer.models.weights import expected_weights

    weights = {}
    for name, spec in expected_weights(config).items():
        if spec.optional or ".ffn.experts." in name:
            continue
        dtype = torch.float8_e4m3fn if spec.quant == "fp8" else spec.dtype
        weights[name] = torch.empty(spec.shape, dtype=dtype, device="meta")
        if spec.quant == "fp8":
            weights[name.removesuffix("weight") + "scale"] = torch.empty(spec.scale_shape(), device="meta")
    d, inter, e = config.hidden_size, config.moe_intermediate_size, config.n_routed_experts
    for layer in range(config.num_hidden_layers):
        for w, (o, i) in {"w1": (inter, d), "w2": (d, inter), "w3": (inter, d)}.items():
            prefix = f"layers.{layer}.ffn.experts.{w}"
            weights[f"{prefix}.weight"] = torch.empty(e, o, i // 2, dtype=torch.uint8, device="meta")
            weights[f"{prefix}.scale"] = torch.empty(e, o, i // 32, device="meta")
    return DeepseekV41Flash(config, weights)


@pytest.mark.parametrize("nested", [False, True])
def test_config_fields_give_the_shapes_the_plan_tunes(tmp_path, nested) -> None:
    """Every tunable kernel node that compile() plans for a checkpoint of this config is a job `autotune` runs."""
    from autotune.run import load_config, statics
    from deepinfer.config import DeepseekV41Config
    from dsl.passes import run_passes
    from graphs.passes import make_plan

    path = write_config(tmp_path, SMALL, nested)
    cfg = load_config(path)
    assert cfg["hidden_size"] == 256 and cfg["vocab_size"] == 1024 and cfg["index_n_heads"] == 8
    model = meta_checkpoint_model(DeepseekV41Config.from_pretrained(path))
    plan = make_plan(run_passes(model.graph()), model.params(), "sm90", buckets=(16,))
    planned = {(n.template, n.static) for n in plan.kernel_nodes() if n.template in MODULES}
    jobs = set(statics(cfg))
    assert {t for t, _ in planned} == set(MODULES)
    assert planned <= jobs, planned - jobs
    assert ("linear", LinearStatic(n=1024, k=256, groups=1, fmt="plain")) in planned


def test_autotune_flags_parse_into_jobs(tmp_path) -> None:
    from autotune.run import prepare, statics
    from deepinfer.cli import build_parser

    path = write_config(tmp_path, SMALL)
    args = build_parser().parse_args(["autotune", "--config", str(path), "--target", "sm90", "--templates",
                                      "linear,hc_mixes", "--buckets", "1,16,64", "--out", str(tmp_path / "t.json"),
                                      "--only", "groups=1"])
    assert (args.command, args.target, args.out, args.no_progress) == ("autotune", "sm90", str(tmp_path / "t.json"),
                                                                      False)
    cfg, work = prepare(args)
    linears = [st for t, st in statics(cfg) if t == "linear" and st.groups == 1]
    # --only keeps the shapes that have the key with that value: hc_mixes has no `groups`
    assert work == [("linear", st, b) for st in linears for b in (1, 16, 64)] and len(linears) == 8


def test_autotune_leaves_prefill_linears_to_the_prefill_gemm(tmp_path, capsys) -> None:
    """Where plans run a linear on the prefill GEMM (`linear_prefill.serves`: here every one at 8192 tokens, none of
    these narrow ones at 512), a linear.py config tuned there would replace it: left out, and said."""
    from autotune.run import load_config, select_work, statics
    from autotune.space import get_configs

    cfg = load_config(write_config(tmp_path, SMALL))
    work = select_work(cfg, ["linear", "moe_experts"], [512, 8192])
    linears = [st for t, st in statics(cfg) if t == "linear"]
    assert [st for t, st, b in work if t == "linear"] == linears and {b for t, _, b in work if t == "linear"} == {512}
    assert {b for t, _, b in work if t == "moe_experts"} == {512, 8192}
    said = capsys.readouterr().err
    assert said.startswith("linear left out where plans run the prefill GEMM") and said.count(" at 8192") == len(
        linears)
    assert get_configs("linear", next(st for t, st, _ in work if t == "linear"), 512)  # still tunable there


def test_autotune_without_a_gpu_says_so(monkeypatch, capsys) -> None:
    from deepinfer.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="autotuning needs a CUDA GPU of the target's architecture; this machine "
                                         "has none"):
        main(["autotune", "--templates", "hc_mixes"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(SystemExit, match=r"sm90 needs a CUDA GPU of that architecture \(sm_90\); this machine has "
                                         r"NVIDIA A100 \(sm_80\)"):
        main(["autotune", "--target", "sm90"])


@pytest.mark.parametrize("content,message", [
    (None, "no config file at"),
    ("{not json", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
    (json.dumps({"model_type": "llama"}), "has none of the fields tuning reads"),
    (json.dumps({"hidden_size": "5120"}), "`hidden_size` must be a positive integer, got '5120'"),
    (json.dumps({"moe_intermediate_size": 0}), "`moe_intermediate_size` must be a positive integer"),
    (json.dumps({"num_attention_heads": 64, "o_groups": 6}), "not a multiple of `o_groups`"),
])
def test_autotune_rejects_a_bad_config_before_looking_for_a_gpu(tmp_path, monkeypatch, content, message) -> None:
    from deepinfer.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit, match=message):
        main(["autotune", "--config", str(path)])


@pytest.mark.parametrize("flags,message", [(["--templates", "linear,gemm"], "unknown template"),
                                           (["--buckets", "16,x"], "--buckets takes integers"),
                                           (["--buckets", "0"], "positive token counts"),
                                           (["--target", "sm80"], "no tuning for target 'sm80'")])
def test_autotune_rejects_bad_flags(monkeypatch, flags, message) -> None:
    from deepinfer.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=message):
        main(["autotune", *flags])


@pytest.mark.gpu
def test_autotune_command_writes_a_cache_on_the_gpu(tmp_path, capsys) -> None:
    """A small config's hyper-connection mixes tuned for real: the cache holds this device's entry, which a plan
    for the same shapes then picks."""
    from autotune import choose
    from deepinfer.cli import main

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("an sm90 GPU")
    out = tmp_path / "tuned.json"
    status = main(["autotune", "--config", str(write_config(tmp_path, SMALL)), "--templates", "hc_mixes",
                   "--buckets", "16", "--out", str(out), "--jobs", "1", "--no-progress"])
    assert status == 0 and "hc_mixes" in capsys.readouterr().out
    cache = TuningCache(out)
    (key,) = cache.entries
    assert key.split("|")[4] == torch.cuda.get_device_name()
    static = {"hc": 4, "d": 256}
    src = template_hash("hc_mixes")
    assert choose("hc_mixes", static, 16, "sm90", src, dict, cache, device=torch.cuda.get_device_name())[1] == "tuned"
