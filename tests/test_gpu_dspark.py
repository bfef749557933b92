"""DSpark drafting on the sm90 target: the draft graph planned and built beside the model's (on any machine), saved in
the artifact and read back; on the H200, drafting is lossless against decoding without it (greedy and seeded, in
batch-invariant mode) and its drafts are accepted."""

from __future__ import annotations

import json

import pytest
import torch

import deepinfer
from deepinfer import LLM, SamplingParams
from deepinfer.default_model import trained_model
from graphs import artifact
from tests.test_dspark import check_lossless_and_accepts

DRAFTING = {"method": "dspark", "num_speculative_tokens": 5}


def test_a_drafting_artifact_holds_the_draft_plan(tmp_path) -> None:
    model = trained_model()
    compiled = deepinfer.compile(model, "sm90", drafting=True)
    assert compiled.draft_plan is not None and compiled.draft_plan.kernel_nodes()
    assert not any(n.template for n in compiled.draft_plan.nodes if n.op == "sparse_attention")  # blocks: torch
    compiled.save(tmp_path)
    assert json.loads((tmp_path / "manifest.json").read_text())["drafting"] is True
    draft_plan = artifact.read(tmp_path)[4]
    assert draft_plan is not None and draft_plan.to_json() == compiled.draft_plan.to_json()
    loaded = deepinfer.load(tmp_path, model)  # rebuilds both graphs and checks the plans against them
    assert loaded.draft_graph is not None and len(loaded.draft_graph.nodes) == len(draft_plan.nodes)
    plain = deepinfer.compile(model, "sm90")
    plain.save(tmp_path / "plain")
    assert artifact.read(tmp_path / "plain")[4] is None
    assert deepinfer.load(tmp_path / "plain", model).draft_graph is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0),
                                    SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, seed=1)],
                         ids=["greedy", "seeded"])
def test_drafting_on_sm90_is_lossless_and_accepts(params: SamplingParams) -> None:
    model = trained_model()
    off = LLM(model, target="sm90", max_num_seqs=4)
    on = LLM(model, target="sm90", max_num_seqs=4, speculative_config=DRAFTING)
    check_lossless_and_accepts(off, on, params)
