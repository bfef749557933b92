"""Engram tables in host memory (graphs/engram_storage.py): the rows fetched ahead of each Engram layer give bitwise
the outputs of tables stored with the other weights."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.default_model import default_checkpoint
from graphs.engram_storage import HostEngramRows

PROMPTS = ["def fib(n):", {"prompt_token_ids": list(range(100, 260))}]  # the second is prefilled in two chunks
PARAMS = [SamplingParams(max_tokens=6, temperature=0, logprobs=3), SamplingParams(max_tokens=5, temperature=0.8, seed=3)]


def host_rows(llm: LLM) -> HostEngramRows:
    return llm.compiled.runtime.overrides["engram_hash_rows"].__self__


def test_host_storage_gives_device_storage_s_outputs() -> None:
    device = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=128, engram_storage="device")
    host = LLM(default_checkpoint(), max_num_seqs=4, max_num_batched_tokens=128, engram_storage="host")
    assert not device.compiled.runtime.overrides
    want = device.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = host.generate(PROMPTS, PARAMS, use_tqdm=False)
    for g, w in zip(got, want, strict=True):
        assert g.outputs == w.outputs
    rows = host_rows(host)
    assert len(rows.layers) == len(host.config.engram_layer_ids) == 2
    assert rows.stats.num_fetches == 2 * host.engine.num_steps  # every forward fetched each layer's rows once
    assert rows.stats.fetch_s > 0


def test_the_fetches_start_before_the_first_layer() -> None:
    """`engram_ngrams` starts every layer's fetch; the layers take them in order."""
    llm = LLM(default_checkpoint(), engram_storage="host")
    rows = host_rows(llm)
    seq = llm.compiled.new_sequence()
    started: list[int] = []

    def ngrams(*args, **kwargs):  # the real op, then how many fetches it left running
        out = rows.ngrams(*args, **kwargs)
        started.append(len(rows._pending))
        return out

    llm.compiled.runtime.overrides["engram_ngrams"] = ngrams
    llm.compiled.step([(seq, [5, 6, 7])])
    assert started == [2] and not rows._pending  # both layers' fetches started there, both taken by their layers


def test_an_unknown_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="engram_storage must be 'host', 'device' or None"):
        LLM(default_checkpoint(), engram_storage="disk")
