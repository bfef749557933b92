"""LLM's first hour: bad requests fail alone and leave nothing behind, a target or model that cannot run is named at
once, the model and the cpu threads are said in one line."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest
import torch

from deepinfer.cpu_threads import choose_threads
from deepinfer.llm import LLM, DeviceUnavailableError, check_target
from deepinfer.sampling_params import SamplingParams
from tests.conftest import fixture_dir, oracle

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(fixture_dir("v41-smooth")), max_model_len=80)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return oracle("v41-smooth")["input_ids"][0].tolist()


def test_bad_requests_of_any_kind_fail_alone_with_a_message_naming_them(llm: LLM, prompt: list[int]) -> None:
    good = {"prompt_token_ids": prompt}
    requests = [good, {"prompt_token_ids": 5}, "a\ud800b", {"prompt": 7}, {"prompt_token_ids": prompt, "images": 1},
                good, {"prompt_token_ids": [1.5]}, 3.0, good]
    params = [GREEDY] * 7 + [GREEDY, {"temperature": 0}]  # the last good prompt: params that are not SamplingParams
    outs = llm.generate(requests, params, use_tqdm=False)
    expected = [None, "prompt_token_ids must be a list of token ids, got int",
                "not valid Unicode text: a lone surrogate U+D800 at character 1",
                "the prompt must be a string, got int",
                "prompt keys ['images'] are not supported", None, "prompt token id 1.5 is outside the vocabulary",
                "a prompt is a string", "sampling params must be a SamplingParams, got dict"]
    for out, needle in zip(outs, expected, strict=True):
        if needle is None:
            assert out.error is None and len(out.outputs[0].token_ids) == 6
        else:
            assert out.error is not None and needle in out.error, (needle, out.error)
            assert [c.finish_reason for c in out.outputs] == ["error"]
    assert outs[0].outputs[0].token_ids == outs[5].outputs[0].token_ids


class _Failing(Sequence):
    """A lazy dataset whose third prompt cannot be read: generate() raises after queuing two."""

    def __init__(self, prompt: list[int]) -> None:
        self.prompt = prompt

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        if i == 2:
            raise OSError("the dataset's third row is unreadable")
        return {"prompt_token_ids": self.prompt}


def test_nothing_queued_leaks_into_the_next_call(llm: LLM, prompt: list[int]) -> None:
    with pytest.raises(OSError, match="third row"):
        llm.generate(_Failing(prompt), GREEDY, use_tqdm=False)
    stream = llm.iter_generate([{"prompt_token_ids": prompt}] * 3, GREEDY)
    next(stream)
    stream.close()  # the caller stopped after one of three
    outs = llm.generate([{"prompt_token_ids": prompt[:10]}], GREEDY, use_tqdm=False)
    assert len(outs) == 1 and outs[0].prompt_token_ids == prompt[:10] and outs[0].error is None
    assert not llm.engine.requests and not llm.engine.scheduler.has_unfinished


def test_whole_arguments_of_the_wrong_type_are_a_type_error(llm: LLM) -> None:
    with pytest.raises(TypeError, match="prompts must be a prompt or a list of prompts, got int"):
        llm.generate(5)
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate(["a"], {"temperature": 0})
    with pytest.raises(TypeError, match="LLM\\(\\) got an unexpected keyword argument 'modle'; did you mean 'model'"):
        LLM(modle=str(fixture_dir("v41-smooth")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_gpu_target_without_a_gpu_is_refused_before_anything_loads(monkeypatch) -> None:
    import deepinfer.llm

    monkeypatch.setattr(deepinfer.llm.LLM, "_load", lambda *a: pytest.fail("the model was loaded first"))
    with pytest.raises(DeviceUnavailableError, match="target 'sm90' runs on an NVIDIA Hopper GPU, and torch sees no"):
        LLM(target="sm90")
    with pytest.raises(DeviceUnavailableError, match="device='cuda': torch sees no CUDA GPU"):
        check_target("cpu", "cuda")
    with pytest.raises(ValueError, match="unknown target 'sm80'"):
        check_target("sm80")


def test_a_missing_model_folder_is_named(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="model '.*nowhere': no such directory"):
        LLM(str(tmp_path / "nowhere"))


def test_one_line_names_the_model_its_size_and_the_threads(caplog: pytest.LogCaptureFixture) -> None:
    threads = torch.get_num_threads()
    with caplog.at_level(logging.INFO, logger="deepinfer.llm"):
        llm = LLM(max_num_seqs=2)
    assert torch.get_num_threads() == threads  # the chosen count holds while the model compiles and generates only
    seen = []
    llm.engine.runner.compiled.step = _recording(llm.engine.runner.compiled.step, seen)
    llm.generate("def f():", SamplingParams(max_tokens=2), use_tqdm=False)
    assert set(seen) == {llm._threads or threads} and torch.get_num_threads() == threads
    (line,) = [r.getMessage() for r in caplog.records if r.name == "deepinfer.llm"]
    assert "the embedded default, a tiny DeepSeek-V4.1-Flash of 11.2M parameters" in line
    assert "trained on the Python standard library's sources" in line and "target cpu, " in line
    assert " thread" in line and "cores, load" in line


def _recording(step, seen: list[int]):
    def recorded(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    return recorded


def test_threads_are_the_cores_other_processes_leave_idle() -> None:
    assert choose_threads(8, 0.0) == 8  # idle: every core
    assert choose_threads(8, 1.0) == 8  # only this process's own thread running
    assert choose_threads(2, 6.0) == 1  # a busy 2-core machine: one thread
    assert choose_threads(16, 5.0) == 12
    assert choose_threads(1, 0.0) == 1
