"""A compiled model: the planned graph of a model for one target, its parameters, and how to run it."""

from __future__ import annotations

import torch

from deepinfer.batch_invariant import KERNELS as BATCH_INVARIANT_KERNELS
from deepinfer.config import DeepseekV41Config
from dsl.context import ForwardContext, SequenceState
from dsl.graph import Graph
from dsl.interpret import interpret


class CompiledModel:
    """Runs forwards over one chunk of tokens from each of several sequences.

    `forward(input_ids)` is the stateless view (fresh sequences, logits of every token); `new_sequence()` and
    `step()` are the incremental one. Sequences made by `new_sequence()` keep their caches as tensors of their own;
    the engine gives its sequences slots and blocks of shared pools (`CacheSpec.from_graph` says what they hold).
    """

    def __init__(self, config: DeepseekV41Config, graph: Graph, params: dict[str, torch.Tensor], target: str) -> None:
        self.config = config
        self.graph = graph
        self.params = params
        self.target = target

    def new_sequence(self) -> SequenceState:
        return SequenceState()

    @torch.inference_mode()
    def step(self, batch: list[tuple[SequenceState, list[int]]], all_logits: bool = False,
             batch_invariant: bool = False) -> torch.Tensor:
        """Run one chunk of tokens per sequence and advance the sequences.

        Returns fp32 logits [num_seqs, vocab] after each chunk's last token, or [total tokens, vocab] for every
        token when `all_logits`. Every chunk must hold at least one token. With `batch_invariant` each row's logits
        are bitwise independent of the batch and of chunking (deepinfer/batch_invariant.py), at some cost.
        """
        states = [s for s, _ in batch]
        lengths = [len(tokens) for _, tokens in batch]
        if any(n == 0 for n in lengths):
            raise ValueError("every sequence in a step needs at least one token")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a sequence appears twice in one step")
        ids = torch.tensor([t for _, tokens in batch for t in tokens], dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got {int(ids.min())}.."
                             f"{int(ids.max())}")
        rows = None if all_logits else torch.tensor(lengths).cumsum(0) - 1
        ctx = ForwardContext(states, lengths, logit_rows=rows)
        kernels = BATCH_INVARIANT_KERNELS if batch_invariant else None
        logits = interpret(self.graph, {"input_ids": ids}, self.params, ctx, kernels)["logits"]
        ctx.commit()
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32) of B fresh sequences of T tokens each: input_ids LongTensor [B, T]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        batch, tokens = input_ids.shape
        if tokens == 0:
            return torch.zeros(batch, 0, self.config.vocab_size)
        logits = self.step([(self.new_sequence(), row.tolist()) for row in input_ids], all_logits=True)
        return logits.reshape(batch, tokens, -1)
