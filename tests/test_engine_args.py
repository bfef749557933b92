"""Engine arguments as a ported vLLM script passes them, and the cache budget that sizes max_model_len."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from deepinfer.checkpoint import save_checkpoint
from deepinfer.default_model import default_config, random_weights
from deepinfer.engine.block_manager import CacheLayout
from deepinfer.engine.engine_args import DEFAULT_CPU_CACHE_BYTES, VLLM_OPTIONS_WITHOUT_EFFECT, EngineArgs
from deepinfer.engine.memory import plan_caches
from deepinfer.llm import LLM
from dsl.cache import CacheSpec
from tests.test_block_manager import SPEC


def test_an_unknown_argument_names_the_closest_valid_one() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'modle'; did you mean 'model'"):
        EngineArgs.from_kwargs({"modle": "x"}, "LLM()", ["model", "target"])
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        EngineArgs.from_kwargs({"max_num_seq": 4})
    with pytest.raises(TypeError, match="valid names: "):
        EngineArgs.from_kwargs({"zzzz": 1})


def test_vllm_options_without_effect_are_logged_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    assert len(VLLM_OPTIONS_WITHOUT_EFFECT) <= 12  # a short, explicit list
    with caplog.at_level(logging.INFO, logger="deepinfer.engine.engine_args"):
        args = EngineArgs.from_kwargs({"dtype": "bfloat16", "trust_remote_code": True, "max_num_seqs": 3,
                                       "tensor_parallel_size": 1})
    assert args == EngineArgs(max_num_seqs=3)
    assert "dtype='bfloat16' has no effect" in caplog.text and "trust_remote_code=True has no effect" in caplog.text


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_parallelism_above_one_points_to_expert_parallelism(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name}=2: .*expert_parallel_size is the way to use several devices"):
        EngineArgs.from_kwargs({name: 2})


def test_gpu_memory_utilization_sizes_the_budget_from_free_memory() -> None:
    assert EngineArgs().gpu_memory_utilization == 0.9
    assert EngineArgs().cache_bytes() == DEFAULT_CPU_CACHE_BYTES  # the cpu: a fixed budget
    assert EngineArgs().cache_bytes(free_device_bytes=10 << 30) == int(0.9 * (10 << 30))
    assert EngineArgs(gpu_memory_utilization=0.5).cache_bytes(8 << 30) == 4 << 30
    assert EngineArgs(kv_cache_memory_bytes=123).cache_bytes(8 << 30) == 123  # given: it wins
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
            EngineArgs(gpu_memory_utilization=bad)


def test_max_model_len_is_the_smaller_of_the_config_and_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    slot, block = SPEC.slot_bytes(), SPEC.block_bytes(16)
    args = EngineArgs(max_num_seqs=4, kv_cache_memory_bytes=4 * slot + 10 * block)
    assert CacheLayout.longest_sequence(SPEC, args.cache_bytes(), 4) == 160
    with caplog.at_level(logging.INFO, logger="deepinfer.engine.memory"):
        layout, length = plan_caches(SPEC, args, 1 << 20, "cpu")
    assert length == 160 and layout.num_blocks == 10
    assert "max_model_len 160: the longest sequence the cache budget" in caplog.text and "allows 1048576" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="deepinfer.engine.memory"):
        assert plan_caches(SPEC, args, 100, "cpu")[1] == 100
    assert len(caplog.records) == 1 and "the config's max_position_embeddings" in caplog.text
    assert plan_caches(SPEC, EngineArgs(max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=10**6), 100,
                       "cpu")[1] == 64  # given: used as it is
    with pytest.raises(ValueError, match="holds no sequence beside the slots of max_num_seqs=4"):
        plan_caches(SPEC, EngineArgs(max_num_seqs=4, kv_cache_memory_bytes=4 * slot), 100, "cpu")


def _million_position_checkpoint(directory: Path) -> Path:
    """A random-weight V4.1 whose caches take some 600 bytes a token (head_dim 512, index keys of 256), and whose
    config says 1,048,576 positions, as a real checkpoint's does: more than the cpu's 512 MiB budget holds."""
    config = default_config().replace(head_dim=512, qk_rope_head_dim=64, index_head_dim=256,
                                      max_position_embeddings=1 << 20, rope_parameters=None)
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config.to_dict()))
    save_checkpoint(random_weights(config), directory)
    return directory


def test_a_checkpoint_of_a_million_positions_opens_with_the_defaults(tmp_path: Path) -> None:
    llm = LLM(str(_million_position_checkpoint(tmp_path / "v41-1m")))
    assert llm.config.max_position_embeddings == 1 << 20
    holds = CacheLayout.longest_sequence(CacheSpec.from_graph(llm.compiled.graph), DEFAULT_CPU_CACHE_BYTES, 32)
    assert 0 < llm.max_model_len == holds < 1 << 20  # what the budget holds, not the config's million
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 16


@pytest.mark.gpu
def test_on_a_gpu_the_budget_is_a_share_of_the_memory_left_after_the_weights(caplog: pytest.LogCaptureFixture) -> None:
    from tests.conftest import fixture_dir

    with caplog.at_level(logging.INFO, logger="deepinfer.engine.memory"):
        roomy = LLM(str(fixture_dir("v41-tiny")), target="sm90", max_num_seqs=4)
        tight = LLM(str(fixture_dir("v41-tiny")), target="sm90", max_num_seqs=4, gpu_memory_utilization=1e-5)
    assert "gpu_memory_utilization=0.9 of" in caplog.text and "gpu_memory_utilization=1e-05 of" in caplog.text
    assert roomy.max_model_len == 1 << 20 and tight.max_model_len < 1 << 20  # 1e-5 of an H200: a MiB or so
    assert tight.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].error is None
