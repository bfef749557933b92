"""Step schedules the static-step tests run twice, on two compiled models, with the same token ids: sequences joining,
decoding, verifying drafts and taking back the rejected ones, finishing, and preempted then recomputed from their
first token, in pools with scattered block tables, as the engine's block manager gives them out."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsl.cache import CacheSpec, PagedCache
from dsl.context import SequenceState
from graphs.compiled_model import CompiledModel

SPARE = 3  # drafts a verification step may take back: its chunks hold up to SPARE + 1 tokens
BLOCK_SIZE = 8


@dataclass
class Pools:
    """Slots and blocks of one `PagedCache`, handed out lowest slot last and blocks in a scattered order."""

    cache: PagedCache
    free_slots: list[int] = field(default_factory=list)
    free_blocks: list[int] = field(default_factory=list)

    @classmethod
    def make(cls, compiled: CompiledModel, slots: int = 4, blocks: int = 48, device: str = "cpu") -> Pools:
        cache = PagedCache(CacheSpec.from_graph(compiled.graph, spare=SPARE), slots, blocks, BLOCK_SIZE, device=device)
        return cls(cache, list(range(slots)), [(7 * b) % blocks for b in range(blocks)])


class Schedule:
    """Sequences by name over `pools`: each with its state and every token id it was fed."""

    def __init__(self, compiled: CompiledModel, pools: Pools, seed: int = 0) -> None:
        self.compiled, self.pools = compiled, pools
        self.states: dict[str, SequenceState] = {}
        self.tokens: dict[str, list[int]] = {}
        self.gen = torch.Generator().manual_seed(seed)
        self.num_fitting = 0  # steps whose every chunk fits a static step (dsl/step.py)

    def join(self, name: str) -> None:
        """A new sequence (or a preempted one back, to be recomputed from its first token) in a free slot."""
        self.states[name] = SequenceState(cache=self.pools.cache, slot=self.pools.free_slots.pop())
        self.tokens.setdefault(name, [])

    def leave(self, name: str) -> None:
        """A sequence finished or preempted: its slot and blocks go back (its tokens are kept for a recompute)."""
        state = self.states.pop(name)
        self.pools.free_slots.append(state.slot)
        self.pools.free_blocks += state.block_table

    def step(self, chunks: dict[str, int], batch_invariant: bool) -> torch.Tensor:
        """One step: `chunks[name]` new tokens for each sequence named (a sequence back from preemption takes its
        recomputed tokens first), every row's logits."""
        batch = []
        self.num_fitting += max(chunks.values()) <= SPARE + 1
        for name, n in chunks.items():
            state = self.states[name]
            done, history = state.num_tokens, self.tokens[name]
            if done + n > len(history):
                history += torch.randint(4, 500, (done + n - len(history),), generator=self.gen).tolist()
            while len(state.block_table) * BLOCK_SIZE < done + n:
                state.block_table.append(self.pools.free_blocks.pop())
            batch.append((state, history[done: done + n]))
        return self.compiled.step(batch, all_logits=True, batch_invariant=batch_invariant)

    def draft(self, names: list[str], batch_invariant: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A DSpark draft pass over a block per sequence named: its last token, then noise tokens; (hidden, logits)."""
        cfg = self.compiled.config
        noise = [cfg.dspark_noise_token_id] * (cfg.dspark_block_size - 1)
        batch = [(self.states[n], self.tokens[n][self.states[n].num_tokens - 1: self.states[n].num_tokens] + noise)
                 for n in names]
        return self.compiled.draft(batch, batch_invariant=batch_invariant)

    def take_back(self, name: str, count: int) -> None:
        """Rejected drafts: the sequence's last `count` tokens taken back (and forgotten)."""
        state = self.states[name]
        self.compiled.rollback(state, state.num_tokens - count, SPARE)
        del self.tokens[name][state.num_tokens:]


def mixed(schedule: Schedule, prefill: bool = False) -> list[torch.Tensor]:
    """Eight steps crossing the window (8 on the fixtures) and block (8 positions) boundaries: sequences joining in
    chunks that fit a static step (or, with `prefill`, the first one in a prefill chunk that does not), decode and
    verification steps with drafts taken back, a sequence finishing, another preempted and recomputed from its first
    token in chunks. Batch-invariant and plain steps alternate. Returns every step's logits."""
    s, out = schedule, []

    def step(chunks: dict[str, int]) -> None:
        out.append(s.step(chunks, batch_invariant=len(out) % 2 == 1))

    s.join("a")
    s.join("b")
    step({"a": 6 if prefill else 4, "b": 3})
    step({"a": 4, "b": 4})  # verification
    s.take_back("a", 2)
    s.take_back("b", 1)
    step({"a": 1, "b": 3})
    s.leave("b")  # finished
    s.join("c")
    step({"a": 4, "c": 2})
    s.take_back("a", 3)
    s.leave("a")  # preempted
    step({"c": 1})
    s.join("a")
    step({"a": 4, "c": 1})  # recomputed in chunks
    step({"a": len(s.tokens["a"]) - 4, "c": 4})
    step({"a": 1, "c": 1})
    return out


__all__ = ["BLOCK_SIZE", "SPARE", "Pools", "Schedule", "mixed"]
