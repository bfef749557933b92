"""A compiled model: the planned graph of a model for one target, its parameters, and how to run it."""

from __future__ import annotations

import contextlib

import torch

from deepinfer.config import DeepseekV41Config
from dsl.context import ForwardContext, SequenceState
from dsl.graph import Graph
from dsl.interpret import interpret
from dsl.ops import invariant_references


class CompiledModel:
    """Runs forwards over one chunk of tokens from each of several sequences.

    `forward(input_ids)` is the stateless view (fresh sequences, logits of every token); `new_sequence()` and
    `step()` are the incremental one. Sequences made by `new_sequence()` keep their caches as tensors of their own;
    the engine gives its sequences slots and blocks of shared pools (`CacheSpec.from_graph` says what they hold).
    Compiled with DSpark drafting (`draft_graph` set), every step also writes the draft layers' main keys, `draft()`
    runs the draft layers over blocks and `rollback()` takes back a step's rejected tokens.
    """

    def __init__(self, config: DeepseekV41Config, graph: Graph, params: dict[str, torch.Tensor], target: str,
                 draft_graph: Graph | None = None, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.graph = graph
        self.params = params
        self.target = target
        self.draft_graph = draft_graph
        self.device = torch.device(device)

    def new_sequence(self) -> SequenceState:
        return SequenceState()

    @torch.inference_mode()
    def step(self, batch: list[tuple[SequenceState, list[int]]], all_logits: bool = False,
             batch_invariant: bool = False, num_logits: list[int] | None = None) -> torch.Tensor:
        """Run one chunk of tokens per sequence and advance the sequences.

        Returns fp32 logits [num_seqs, vocab] after each chunk's last token, or [total tokens, vocab] for every
        token when `all_logits`, or after the last `num_logits[i]` tokens of chunk i, in order. Every chunk must
        hold at least one token. With `batch_invariant` each row's logits are bitwise independent of the batch and
        of chunking (deepinfer/batch_invariant.py), at some cost.
        """
        states, lengths, ids = self._chunks(batch)
        if all_logits:
            rows = None
        else:
            ends = torch.tensor(lengths).cumsum(0)
            counts = num_logits or [1] * len(batch)
            if any(not 1 <= k <= n for k, n in zip(counts, lengths, strict=True)):
                raise ValueError(f"num_logits {counts} must lie in [1, chunk length] for chunks of {lengths}")
            rows = torch.cat([torch.arange(int(e) - k, int(e)) for e, k in zip(ends, counts, strict=True)])
            rows = rows.to(self.device)
        ctx = ForwardContext(states, lengths, self.device, logit_rows=rows)
        logits = interpret(self.graph, {"input_ids": ids}, self.params, ctx, self._kernels(batch_invariant))["logits"]
        ctx.commit()
        return logits

    @torch.inference_mode()
    def draft(self, batch: list[tuple[SequenceState, list[int]]],
              batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the DSpark draft layers over one block per sequence, at the sequence's next positions, leaving the
        sequences as they were. Returns fp32 (hidden [total tokens, hidden_size], logits [total tokens, vocab])."""
        if self.draft_graph is None:
            raise RuntimeError("this model was compiled without DSpark drafting: compile(..., drafting=True)")
        states, lengths, ids = self._chunks(batch)
        ctx = ForwardContext(states, lengths, self.device)
        out = interpret(self.draft_graph, {"input_ids": ids}, self.params, ctx, self._kernels(batch_invariant))
        return out["hidden"], out["logits"]

    def capture_ahead(self, tokens: int) -> None:
        """A GPU target's CUDA graphs of every decode bucket up to `tokens` (deepinfer/compiled_gpu.py); none here."""

    def sampling(self) -> contextlib.AbstractContextManager:
        """What the engine samples in: launches as they are (logits on a CUDA device sample on Triton's JIT)."""
        return contextlib.nullcontext()

    def rollback(self, state: SequenceState, num_tokens: int, spare: int) -> None:
        """Take back the tokens of `state` from `num_tokens` on, at most `spare` (what its caches' rings keep)."""
        if not state.num_tokens - spare <= num_tokens <= state.num_tokens:
            raise ValueError(f"cannot take a sequence of {state.num_tokens} tokens back to {num_tokens}: at most "
                             f"{spare} tokens can be taken back")
        state.num_tokens = num_tokens

    def _chunks(self, batch: list[tuple[SequenceState, list[int]]]) -> tuple[list, list[int], torch.Tensor]:
        """The states, chunk lengths and flat token ids of a batch, checked."""
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
        return states, lengths, ids.to(self.device)

    @staticmethod
    def _kernels(batch_invariant: bool) -> dict | None:
        return invariant_references() if batch_invariant else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32) of B fresh sequences of T tokens each: input_ids LongTensor [B, T]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        batch, tokens = input_ids.shape
        if tokens == 0:
            return torch.zeros(batch, 0, self.config.vocab_size)
        logits = self.step([(self.new_sequence(), row.tolist()) for row in input_ids], all_logits=True)
        return logits.reshape(batch, tokens, -1)
