"""Parity with the reference on the four fixtures: full forward, incremental decoding, chunked prefill, batches.

Smooth fixtures strictly (1e-4 relative L2, identical greedy tokens); discrete ones within the reference's own
spread under 1e-6 weight noise (spread.json), as the fixtures' README explains.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import DISCRETE, SMOOTH, oracle, rel_l2, spread

ALL = SMOOTH + DISCRETE


def _bound(name: str, key: str) -> float:
    return 1e-4 if name in SMOOTH else max(3 * spread(name)[key], 1e-4)


@pytest.mark.parametrize("name", ALL)
def test_full_forward(name: str, compiled_fixture) -> None:
    model, ref = compiled_fixture(name), oracle(name)
    prompt = model.forward(torch.from_numpy(ref["input_ids"]).long()).numpy()
    full = model.forward(torch.from_numpy(ref["full_ids"]).long()).numpy()
    assert prompt.shape == ref["logits"].shape and prompt.dtype == np.float32
    assert rel_l2(prompt, ref["logits"]) < _bound(name, "max_rel_prompt")
    assert rel_l2(full, ref["full_logits"]) < _bound(name, "max_rel_full")
    agree = (full.argmax(-1) == ref["full_logits"].argmax(-1)).mean()
    assert agree >= (1.0 if name in SMOOTH else spread(name)["min_argmax_agree_full"])


def _greedy(model, prompt: list[int], steps: int, chunk: int | None = None) -> tuple[list[int], np.ndarray]:
    state = model.new_sequence()
    pieces = [prompt] if chunk is None else [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)]
    for piece in pieces:
        logits = model.step([(state, piece)])
    tokens, rows = [], []
    for _ in range(steps):
        rows.append(logits[0].numpy())
        tokens.append(int(logits[0].argmax()))
        logits = model.step([(state, [tokens[-1]])])
    return tokens, np.stack(rows)


@pytest.mark.parametrize("name", ALL)
def test_incremental_decoding(name: str, compiled_fixture) -> None:
    model, ref = compiled_fixture(name), oracle(name)
    want = ref["greedy_tokens"][0].tolist()
    tokens, rows = _greedy(model, ref["input_ids"][0].tolist(), len(want))
    if name in SMOOTH:
        assert tokens == want
        assert rel_l2(rows, ref["greedy_step_logits"][0]) < 1e-4
    else:
        prefix = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=True)) if a != b), len(want))
        assert prefix >= spread(name)["min_greedy_prefix"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_matches_one_shot(name: str, chunk: int, compiled_fixture) -> None:
    """Partial compressor groups, windows and n-gram history carry across chunks of any size."""
    model, ref = compiled_fixture(name), oracle(name)
    prompt = ref["input_ids"][0].tolist()
    one_shot, rows = _greedy(model, prompt, 4)
    chunked, chunked_rows = _greedy(model, prompt, 4, chunk=chunk)
    assert chunked == one_shot
    np.testing.assert_allclose(chunked_rows, rows, rtol=0, atol=1e-4 * np.abs(rows).max())


@pytest.mark.parametrize("name", ["v41-smooth-engram", "v41-tiny"])
def test_batched_sequences_match_alone(name: str, compiled_fixture) -> None:
    model, ref = compiled_fixture(name), oracle(name)
    full = ref["full_ids"][0].tolist()
    prompts = [full[:48], full[5:30], full[:9]]
    alone = [model.step([(model.new_sequence(), p)], all_logits=True) for p in prompts]
    states = [model.new_sequence() for _ in prompts]
    together = model.step(list(zip(states, prompts, strict=True)), all_logits=True)
    torch.testing.assert_close(together, torch.cat(alone), rtol=0, atol=1e-5)
    nxt = model.step([(s, [7]) for s in states])
    for i, p in enumerate(prompts):
        s = model.new_sequence()
        model.step([(s, p)])
        torch.testing.assert_close(nxt[i], model.step([(s, [7])])[0], rtol=0, atol=1e-5)
