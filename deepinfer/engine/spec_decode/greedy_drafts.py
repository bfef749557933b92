"""The greedy drafts' loop: every position's draft of every row as argmax, replayed as a CUDA graph on a GPU."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from deepinfer.dspark import DraftHead, draft_probability


class GreedyDrafts:
    """`greedy(hidden, logits, previous)`: `propose` for rows that all sample greedily with nothing to adjust their
    logits (what `sample` picks for them: the argmax, ties to the lowest id). The drafts of blocks and their
    confidences, (int64 [rows, k], fp32 [rows, k]), from the draft layers' hidden states [rows, k, hidden] and logits
    [rows, k, vocab] and each row's last token [rows]: position i's draft is the argmax of its logits plus the Markov
    term of the token before it.

    Some dozen small launches a position: on a CUDA device they replay as one CUDA graph per shape (the first call at
    a shape runs eagerly, the second captures, later ones replay; at most `max_shapes` kept, the least recently used
    dropped). The returned tensors are the graph's: read them before the next call."""

    def __init__(self, head: DraftHead, confidence: str = "head", max_shapes: int = 8) -> None:
        self.head, self.confidence, self.max_shapes = head, confidence, max_shapes
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()
        self.seen: set[tuple] = set()

    def run(self, hidden: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor,
            draw: Callable | None = None) -> tuple[torch.Tensor, ...]:
        """The loop itself; `draw(i, scores, picks)`, where given, replaces some rows' argmax picks at position i
        (`Drafter._plain_drafts`: the sampled rows')."""
        picks, confidences = [], []
        for i in range(logits.shape[1]):
            emb, markov = self.head.markov(previous)
            if self.confidence == "head":
                confidences.append(self.head.confidence(hidden[:, i], emb))
            scores = logits[:, i] + markov
            previous = torch.argmax(scores, dim=-1)
            if draw is not None:
                previous = draw(i, scores, previous)
            if self.confidence == "draft":
                confidences.append(draft_probability(scores, previous))
            picks.append(previous)
        return torch.stack(picks, dim=1), torch.stack(confidences, dim=1)

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor, logits: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if hidden.device.type != "cuda":
            return self.run(hidden, logits, previous)
        key = (tuple(hidden.shape), tuple(logits.shape), hidden.dtype, logits.dtype)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            graph, inputs, outputs = self.graphs[key]
            for buf, new in zip(inputs, (hidden, logits, previous), strict=True):
                buf.copy_(new)
            graph.replay()
            return outputs
        if key not in self.seen:  # the first call at this shape: eager (its kernels load)
            self.seen.add(key)
            return self.run(hidden, logits, previous)
        while len(self.graphs) >= self.max_shapes:
            self.graphs.popitem(last=False)
        inputs = (hidden.clone(), logits.clone(), previous.clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.run(*inputs)
        graph.replay()
        self.graphs[key] = (graph, inputs, outputs)
        return outputs
