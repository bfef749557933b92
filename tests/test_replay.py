"""train/replay.py's measures of the drafts (train/distill.py exports by them, bench/dspark_oracle.py prints them):
the ranking AUC, the oracle allocation and the scheduled walk (a replay of the verification budget over greedy
continuations), checked on small cases worked by hand."""

from __future__ import annotations

import torch

from train.replay import allocate_oracle, ranking_auc, scheduled_walk
from train.draft import scale_grad


def test_ranking_auc_counts_pairs_and_ties_half() -> None:
    # one sequence, prompt of 1 token: every anchor counts; block of 1, so position 1's runs are 0 or 1
    runs = torch.tensor([[1, 1, 0, 0]])
    lens = torch.tensor([1])
    perfect = torch.tensor([[[0.9], [0.8], [0.2], [0.1]]])
    assert ranking_auc(perfect, runs, lens) == [1.0]
    assert ranking_auc(perfect.flip(1), runs, lens) == [0.0]
    tied = torch.full((1, 4, 1), 0.5)
    assert ranking_auc(tied, runs, lens) == [0.5]
    # accepted {0.9, 0.2}, rejected {0.5, 0.2}: pairs won 0.9>0.5, 0.9>0.2, 0.2=0.2 (half), 0.2<0.5 -> 2.5 / 4
    mixed = torch.tensor([[[0.9], [0.2], [0.5], [0.2]]])
    assert ranking_auc(mixed, runs, lens) == [0.625]


def test_ranking_auc_skips_prompt_anchors_and_uses_cumulative_products() -> None:
    runs = torch.tensor([[0, 2, 1, 0]])  # drafts accepted at anchors 1..4
    lens = torch.tensor([2])  # generation starts at anchor 2: the first column is the prompt's
    conf = torch.tensor([[[0.1, 0.1], [0.9, 0.9], [0.9, 0.1], [0.2, 0.9]]])
    # position 1 over anchors 2..4: accepted (runs > 0) 0.9, 0.9; rejected 0.2 -> 1.0
    # position 2 (products): anchor 2 0.81 accepted; anchors 3, 4: 0.09, 0.18 rejected -> 1.0
    assert ranking_auc(conf, runs, lens) == [1.0, 1.0]
    conf[0, 3] = torch.tensor([0.95, 0.9])  # a rejected draft now outranks both accepted ones at position 1
    assert ranking_auc(conf, runs, lens)[0] == 0.0


def test_allocate_oracle_gives_the_longest_runs_first() -> None:
    runs = torch.tensor([1, 3, 0, 3])
    # 4 requests, budget 9: 5 spare; request 1 (3, the lower index of the tie) then request 3 (2 of its 3 left)
    assert allocate_oracle(runs, 9).tolist() == [0, 3, 0, 2]
    assert allocate_oracle(runs, 4).tolist() == [0, 0, 0, 0]  # one token each, nothing spare
    assert allocate_oracle(runs, 20).tolist() == [1, 3, 0, 3]  # never more than a request will accept


def test_scheduled_walk_by_hand() -> None:
    # two sequences, block of 2, anchors 1..6; prompts of 1 token, so each walk starts at anchor 1
    runs = torch.tensor([[2, 0, 0, 2, 0, 0],
                         [0, 0, 0, 0, 0, 0]])
    lens = torch.tensor([1, 1])
    sure = torch.tensor([[0.9, 0.9]]).expand(6, 2)
    confidences = {"head": torch.stack([sure, torch.full((6, 2), 0.1)])}  # the first is confident, the second not
    out = scheduled_walk(runs, confidences, lens, budget=2.0)  # 4 tokens a step for 2 requests: 2 spare
    # static 2 within budget: request 0 takes both spare drafts, request 1 none.
    # seq 0: anchor 1 accepts 2 (+3) -> 4, accepts 2 (+3) -> 7 (done); seq 1: +1 a step from anchor 1.
    # steps: (2 running: 3 + 1), (2: 3 + 1), then seq 1 alone at anchors 3..6 (4 steps of 1 token) = 12 / 8
    assert out["static 2"] == 1.5
    assert out["head"] == 1.5  # the confident request gets both spare drafts too
    assert out["oracle"] == 1.5
    # static 1: each request gets one draft; seq 0 accepts 1 a step at anchors 1, 3 (runs 0 there: +1) ...
    # seq 0: 1 ->(+2) 3 ->(+1) 4 ->(+2) 6 ->(+1) 7: 4 steps, 6 tokens; seq 1: 6 steps, 6 tokens -> 12 / 10
    assert out["static 1"] == 1.2


def test_scale_grad_keeps_the_value_and_scales_the_gradient() -> None:
    for share, expected in ((0.0, None), (0.25, 0.25), (1.0, 1.0)):
        x = torch.tensor([2.0, -3.0], requires_grad=True)
        y = scale_grad(x, share)
        assert torch.equal(y, x.detach())
        if expected is None:
            assert not y.requires_grad
            continue
        y.sum().backward()
        assert torch.allclose(x.grad, torch.full_like(x, expected))
