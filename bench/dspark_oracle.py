"""How well could a step's verification budget be spent? An offline replay of DSpark's allocation.

    python bench/dspark_oracle.py [--model DIR] [--batch 16] [--max-tokens 48] [--budgets 2,3,4,5]

Generates the benchmark's prompts greedily with every draft verified (static 5), records each proposal (its drafts
and both kinds of confidence: the confidence head's and the draft distribution's probability of each drafted
token), and reads from the final outputs, which drafting does not change, how many of its drafts each proposal got
right. Then, step by step, it replays the allocation at each budget (tokens a step per request): static lengths,
the scheduler's confidence rule (`allocate_by_confidence`) with either confidence, and an oracle that gives each
request exactly the drafts it will accept. It prints tokens a step for each, and per draft position how well each
confidence's cumulative product ranks accepted drafts above rejected ones (AUC: 0.5 is chance, 1 is perfect).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import torch  # noqa: E402
from dspark_bench import DEFAULT_MODEL, prompts_from_stdlib  # noqa: E402

from deepinfer import LLM, SamplingParams  # noqa: E402
from deepinfer.dspark import allocate_by_confidence, allocate_static, draft_probability  # noqa: E402
from train.replay import allocate_oracle, auc  # noqa: E402

K = 5


def record(llm: LLM) -> list[list[tuple]]:
    """Wrap the drafter so every propose call (one step) appends [(request id, outputs so far, drafts, head
    confidences, draft probabilities)] to the returned list."""
    steps: list[list[tuple]] = []
    drafter = llm.engine.runner.speculator.drafter
    propose, greedy = drafter.propose, drafter.greedy
    probabilities: list[torch.Tensor] = []

    def run(hidden, logits, previous):  # the greedy drafts, keeping each pick's probability too
        picks, confidences = greedy.run(hidden, logits, previous)
        before = torch.cat([previous[:, None], picks[:, :-1]], dim=1)  # the token each pick follows
        probabilities.append(torch.stack([draft_probability(logits[:, i] + greedy.head.markov(before[:, i])[1],
                                                            picks[:, i]) for i in range(picks.shape[1])], dim=1))
        return picks, confidences

    def wrapped(rows, fill_next=None, lengths=None):
        out = propose(rows, fill_next, lengths)
        probs = probabilities.pop().tolist()
        steps.append([(s.request_id, len(outputs), p.tokens, p.confidences, probs[j])
                      for j, ((_, s, outputs), p) in enumerate(zip(rows, out, strict=True))])
        return out

    drafter.greedy, drafter.propose = run, wrapped
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--budgets", default="2,3,4,5", help="tokens a step per request")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, max_num_batched_tokens=max(512, 8 * args.batch),
              speculative_config={"num_speculative_tokens": K, "schedule": "static"})
    steps = record(llm)
    outs = llm.generate(prompts_from_stdlib(args.batch),
                        SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    final = {o.request_id: list(o.outputs[0].token_ids) for o in outs}
    replay, by_position = [], collections.defaultdict(list)  # per step: (accepted, available, head, draft) rows
    for step in steps:
        rows = []
        for rid, n, drafts, head, draft in step:
            truth = final[rid][n:]
            if not truth:
                continue
            available = min(len(drafts), len(truth) - 1, K)  # as the scheduler: never past max_tokens
            accepted = next((i for i in range(available) if drafts[i] != truth[i]), available)
            rows.append((accepted, available, head[:K], draft[:K]))
            for i in range(available):
                by_position[i].append((torch.tensor(head[: i + 1]).prod(), torch.tensor(draft[: i + 1]).prod(),
                                       accepted > i))
        if rows:
            replay.append(rows)
    print(f"{len(replay)} steps, {sum(map(len, replay))} proposals ({args.batch} requests, {args.max_tokens} tokens)")
    for i in sorted(by_position):
        head, draft, ok = (torch.tensor(c) for c in zip(*by_position[i], strict=True))
        print(f"position {i + 1}: accepted {ok.double().mean():.3f}; cumulative confidence mean / AUC: head "
              f"{head.mean():.3f} / {auc(head, ok):.3f}, draft {draft.mean():.3f} / {auc(draft, ok):.3f}")
    proposals = sum(map(len, replay))
    for per in (float(b) for b in args.budgets.split(",")):
        tokens = collections.Counter()
        for rows in replay:
            n, budget = len(rows), round(per * len(rows))
            accepted = torch.tensor([r[0] for r in rows])
            available = torch.tensor([r[1] for r in rows])
            for length in range(1, K + 1):
                tokens[f"static {length}"] += (1 + torch.minimum(accepted, allocate_static(length, available,
                                                                                           budget))).sum().item()
            for name, col in (("confidence head", 2), ("confidence draft", 3)):
                conf = torch.zeros(n, K)
                for j, r in enumerate(rows):
                    conf[j, : len(r[col])] = torch.tensor(r[col])
                counts = allocate_by_confidence(conf, available, budget)
                tokens[name] += (1 + torch.minimum(accepted, counts)).sum().item()
            tokens["oracle"] += (1 + torch.minimum(accepted, allocate_oracle(accepted, budget))).sum().item()
        print(f"budget {per:g}/request, tokens a step: " + ", ".join(f"{k} {v / proposals:.3f}"
                                                                     for k, v in tokens.items()))


if __name__ == "__main__":
    main()
