"""A compiled model: a model's planned graph for one target, its weights, and the runtime that runs it.

`deepinfer.compile(model, target=...)` and `deepinfer.load(dir)` return one, whatever the target; its `runtime` is
the one the target's record names (kernels/targets.py): the interpreter or a plan (graphs/runtime.py). The engine
sees it as a `RunnableModel`, the members it uses.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Generic, Protocol, TypeVar, runtime_checkable

import torch

from dsl.context import Draws, ForwardContext, SequenceState
from dsl.graph import Graph
from dsl.transfer import host_to, to_device
from graphs.runtime import Runtime
from graphs.segments import StepSegment


class ModelConfig(Protocol):
    """What a compiled model reads of its model's config (deepinfer.config.DeepseekV41Config)."""

    @property
    def vocab_size(self) -> int: ...

    def to_dict(self) -> dict: ...


ConfigT = TypeVar("ConfigT", bound=ModelConfig)
ConfigT_co = TypeVar("ConfigT_co", bound=ModelConfig, covariant=True)
Batch = list[tuple[SequenceState, list[int]]]  # one chunk of token ids per sequence
# Inputs taken on the device from an earlier step's tokens: (those tokens int64 [R] on the device, the flat input
# rows that take them, the row of the tokens each takes)
Fed = tuple[torch.Tensor, list[int], list[int]]


@runtime_checkable
class RunnableModel(Protocol[ConfigT_co]):
    """What the engine uses of a compiled model (`CompiledModel` is one; see its members)."""

    @property
    def config(self) -> ConfigT_co: ...

    @property
    def graph(self) -> Graph: ...

    @property
    def target(self) -> str: ...

    @property
    def params(self) -> dict[str, torch.Tensor]: ...

    @property
    def device(self) -> torch.device: ...

    def new_sequence(self) -> SequenceState: ...

    def step(self, batch: Batch, all_logits: bool = False, batch_invariant: bool = False,
             num_logits: list[int] | None = None, fed: Fed | None = None, draws: Draws | None = None
             ) -> torch.Tensor: ...

    def draft(self, batch: Batch, batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rollback(self, state: SequenceState, num_tokens: int, spare: int) -> None: ...

    def sampling(self) -> AbstractContextManager: ...

    def capture_ahead(self, tokens: int) -> None: ...

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor: ...


class CompiledModel(Generic[ConfigT]):
    """Runs forwards over one chunk of tokens from each of several sequences.

    `forward(input_ids)` is the stateless view (fresh sequences, logits of every token); `new_sequence()` and
    `step()` are the incremental one. Sequences made by `new_sequence()` keep their caches as tensors of their own;
    the engine gives its sequences slots and blocks of shared pools (`CacheSpec.from_graph` says what they hold).
    Compiled with DSpark drafting (`draft_graph` set), every step also writes the draft layers' main keys, `draft()`
    runs the draft layers over blocks and `rollback()` takes back a step's rejected tokens.
    """

    def __init__(self, config: ConfigT, graph: Graph, target: str, runtime: Runtime,
                 draft_graph: Graph | None = None, model_dir: str | None = None) -> None:
        self.config, self.graph, self.target, self.runtime = config, graph, target, runtime
        self.draft_graph, self.model_dir = draft_graph, model_dir

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The weights as the runtime holds them (a GPU target's: on the host until the first step)."""
        return self.runtime.params

    @property
    def device(self) -> torch.device:
        """Where steps run and their logits are."""
        return self.runtime.device

    def new_sequence(self) -> SequenceState:
        return SequenceState()

    @torch.inference_mode()
    def step(self, batch: Batch, all_logits: bool = False, batch_invariant: bool = False,
             num_logits: list[int] | None = None, fed: Fed | None = None, draws: Draws | None = None) -> torch.Tensor:
        """Run one chunk of tokens per sequence and advance the sequences.

        Returns fp32 logits [num_seqs, vocab] after each chunk's last token, or [total tokens, vocab] for every
        token when `all_logits`, or after the last `num_logits[i]` tokens of chunk i, in order. Every chunk must
        hold at least one token. With `batch_invariant` each row's logits are bitwise independent of the batch and
        of chunking, at some cost. In bounded replay (a graph compiled with `replay`; `SequenceState.replay_from`)
        the rows of a chunk wholly before its sequence's `replay_from` are not computed: NaN. `fed`: inputs whose
        tokens an earlier step left on the device (their ids in `batch` are ignored), taken there without the host
        waiting for them. `draws`: the tokens to draw after each chunk, which a step that draws them inside its
        graph (a GPU target's static step: graphs/draws.py) puts in `draws.tokens`.
        """
        self.runtime.ready()
        states, lengths, ids = self._chunks(batch, fed)
        if draws is not None and not len(draws.factors) == len(draws.seeds) == len(lengths):
            raise ValueError(f"draws need a factor and a seed for each of the {len(lengths)} chunks, got "
                             f"{len(draws.factors)} and {len(draws.seeds)}")
        every = all_logits or (num_logits or [1] * len(lengths)) == lengths  # every row's logits, in order
        rows = None if every else host_to(_logit_rows(lengths, num_logits), self.device)
        ctx = ForwardContext(states, lengths, self.device, logit_rows=rows, draws=draws)
        out = self.runtime.run(ids, ctx, batch_invariant)
        logits = ctx.full_logits(out["logits"])
        if draws is not None and "drawn" in out:  # one per row: each chunk's last row's
            drawn = out["drawn"]
            draws.tokens = drawn if max(lengths) == 1 else drawn[_logit_rows(lengths, None).to(drawn.device)]
        ctx.commit()
        return logits

    @torch.inference_mode()
    def draft(self, batch: Batch, batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the DSpark draft layers over one block per sequence, at the sequence's next positions, leaving the
        sequences as they were. Returns fp32 (hidden [total tokens, hidden_size], logits [total tokens, vocab]).
        Drafts only need to be good, not invariant: verification keeps the output exact."""
        if self.draft_graph is None:
            raise RuntimeError("this model was compiled without DSpark drafting: compile(..., drafting=True)")
        self.runtime.ready()
        states, lengths, ids = self._chunks(batch)
        out = self.runtime.run(ids, ForwardContext(states, lengths, self.device), batch_invariant, draft=True)
        return out["hidden"], out["logits"]

    def graph_segments(self, num_tokens: int, draft: bool = False) -> list[StepSegment]:
        """The segments of a decode step of `num_tokens` tokens (of the draft pass when `draft`), in order, each with
        `.captured` (replayed as one CUDA graph) and `.nodes` (its nodes' names, "index:op"): what the target's
        runtime does with the graph, read without running it (no GPU needed)."""
        return self.runtime.graph_segments(num_tokens, draft)

    def capture_ahead(self, tokens: int) -> None:
        """The most tokens a decode step of the engine runs: a GPU target captures every decode bucket's CUDA graphs
        up to it at its first capture (graphs/capture.py)."""
        self.runtime.capture_ahead(tokens)

    def sampling(self) -> AbstractContextManager:
        """What the engine samples in: on a GPU target the sampling kernel's cubins take its draws."""
        return self.runtime.sampling()

    def rollback(self, state: SequenceState, num_tokens: int, spare: int) -> None:
        """Take back the tokens of `state` from `num_tokens` on, at most `spare` (what its caches' rings keep)."""
        if not state.num_tokens - spare <= num_tokens <= state.num_tokens:
            raise ValueError(f"cannot take a sequence of {state.num_tokens} tokens back to {num_tokens}: at most "
                             f"{spare} tokens can be taken back")
        state.num_tokens = num_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32) of B fresh sequences of T tokens each: input_ids LongTensor [B, T]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        batch, tokens = input_ids.shape
        if tokens == 0:
            return torch.zeros(batch, 0, self.config.vocab_size, device=self.device)
        logits = self.step([(self.new_sequence(), row.tolist()) for row in input_ids], all_logits=True)
        return logits.reshape(batch, tokens, -1)

    def save(self, path: str | Path) -> None:
        """Write the artifact directory that `deepinfer.load(path)` runs (graphs/artifact.py): GPU targets."""
        self.runtime.save(path, self.config.to_dict(), self.model_dir)

    def _chunks(self, batch: Batch, fed: Fed | None = None) -> tuple[list[SequenceState], list[int], torch.Tensor]:
        """The states, chunk lengths and flat token ids (on the device) of a batch, checked; the `fed` rows' ids
        taken from their tokens on the device (the row numbers copied with the ids, in one copy)."""
        states = [s for s, _ in batch]
        lengths = [len(tokens) for _, tokens in batch]
        if any(n == 0 for n in lengths):
            raise ValueError("every sequence in a step needs at least one token")
        if len({id(s) for s in states}) != len(states):
            raise ValueError("a sequence appears twice in one step")
        ids = [t for _, tokens in batch for t in tokens]
        rows, index = ([], []) if fed is None else fed[1:]
        if len(rows) != len(index) or any(not 0 <= r < len(ids) for r in rows):
            raise ValueError(f"fed rows {rows} must be rows of the step's {len(ids)} tokens, one source row each")
        for r in rows:
            ids[r] = 0
        low, high = (min(ids), max(ids)) if ids else (0, 0)
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size}), got {low}..{high}")
        if not rows:
            return states, lengths, to_device(ids, self.device)
        n, k = len(ids), len(rows)
        packed = to_device(ids + rows + index, self.device)
        packed[:n].index_copy_(0, packed[n:n + k], fed[0].to(self.device).index_select(0, packed[n + k:]))
        return states, lengths, packed[:n]


def _logit_rows(lengths: list[int], num_logits: list[int] | None) -> torch.Tensor:
    """The flat token rows whose logits a step returns: the last `num_logits[i]` (default 1) of each chunk."""
    counts = num_logits or [1] * len(lengths)
    if len(counts) != len(lengths) or any(not 1 <= k <= n for k, n in zip(counts, lengths, strict=True)):
        raise ValueError(f"num_logits {counts} must lie in [1, chunk length] for chunks of {lengths}")
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return torch.cat([torch.arange(e - k, e) for e, k in zip(ends, counts, strict=True)])


__all__ = ["Batch", "CompiledModel", "Fed", "ModelConfig", "RunnableModel"]
