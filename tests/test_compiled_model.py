"""The one compiled-model type (graphs/compiled_model.py) on the cpu target: its runtime is the interpreter, it is
what the engine's `RunnableModel` describes, and a step's bad input is refused with what is wrong. GPU targets'
models are loaded and checked in tests/test_artifact.py."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.models import DeepseekV41Flash
from dsl.context import SequenceState
from graphs.compiled_model import CompiledModel, RunnableModel
from graphs.interpreter import Interpreter
from tests.conftest import fixture_dir


@pytest.fixture(scope="module")
def compiled() -> CompiledModel:
    return deepinfer.compile(DeepseekV41Flash.from_pretrained(fixture_dir("v41-tiny")), target="cpu")


def test_the_cpu_target_runs_on_the_interpreter(compiled) -> None:
    assert isinstance(compiled, RunnableModel) and isinstance(compiled.runtime, Interpreter)
    assert compiled.device == torch.device("cpu") and compiled.params is compiled.runtime.params
    assert compiled.draft_graph is None and compiled.runtime.draft_graph is None
    with compiled.sampling():  # launches as they are
        pass
    compiled.capture_ahead(64)  # nothing to capture


def test_the_cpu_target_says_why_it_saves_nothing(compiled, tmp_path) -> None:
    with pytest.raises(ValueError, match="runs every op's torch reference .* so nothing is built to save"):
        compiled.save(tmp_path / "artifact")
    assert not (tmp_path / "artifact").exists()


def test_a_step_refuses_bad_input(compiled) -> None:
    vocab = compiled.config.vocab_size
    a, b = compiled.new_sequence(), compiled.new_sequence()
    with pytest.raises(ValueError, match="every sequence in a step needs at least one token"):
        compiled.step([(a, [1]), (b, [])])
    with pytest.raises(ValueError, match="a sequence appears twice in one step"):
        compiled.step([(a, [1]), (a, [2])])
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {vocab}\), got -1\.\.{vocab}"):
        compiled.step([(a, [-1, 3]), (b, [vocab])])
    with pytest.raises(ValueError, match=r"num_logits \[3, 1\] must lie in \[1, chunk length\] for chunks of \[2, 1\]"):
        compiled.step([(a, [1, 2]), (b, [3])], num_logits=[3, 1])
    with pytest.raises(ValueError, match=r"fed rows \[2\] must be rows of the step's 2 tokens, one source row each"):
        compiled.step([(a, [1]), (b, [-1])], fed=(torch.tensor([4]), [2], [0]))
    with pytest.raises(ValueError, match=r"fed rows \[1\] must be rows"):
        compiled.step([(a, [1]), (b, [-1])], fed=(torch.tensor([4]), [1], [0, 0]))
    assert a.num_tokens == b.num_tokens == 0  # nothing ran
    with pytest.raises(RuntimeError, match="compiled without DSpark drafting"):
        compiled.draft([(a, [1])])
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, tokens\]"):
        compiled.forward(torch.tensor([1, 2, 3]))
    assert compiled.forward(torch.zeros(2, 0, dtype=torch.long)).shape == (2, 0, vocab)


def test_a_step_returns_the_logits_asked_for_and_rollback_keeps_to_its_spare(compiled) -> None:
    ids = [5, 6, 7, 8]
    every = compiled.step([(SequenceState(), ids)], all_logits=True, batch_invariant=True)
    state = SequenceState()
    last_two = compiled.step([(state, ids)], num_logits=[2], batch_invariant=True)
    assert every.shape == (4, compiled.config.vocab_size) and torch.equal(last_two, every[2:])
    assert state.num_tokens == 4
    with pytest.raises(ValueError, match="at most 1 tokens can be taken back"):
        compiled.rollback(state, 2, spare=1)
    compiled.rollback(state, 3, spare=1)
    assert state.num_tokens == 3


def test_fed_inputs_take_an_earlier_steps_tokens(compiled) -> None:
    """A step's `fed` rows take their ids from tokens left on the device (placeholders in the batch): the logits are
    those of the same ids given on the host."""
    earlier = torch.tensor([9, 41, 17])  # an earlier step's tokens
    states = [SequenceState(), SequenceState()]
    want = compiled.step([(states[0], [5, 6, 17]), (states[1], [9])], all_logits=True, batch_invariant=True)
    states = [SequenceState(), SequenceState()]
    got = compiled.step([(states[0], [5, 6, -1]), (states[1], [-1])], all_logits=True, batch_invariant=True,
                        fed=(earlier, [2, 3], [2, 0]))
    assert torch.equal(got, want) and [s.num_tokens for s in states] == [3, 1]
