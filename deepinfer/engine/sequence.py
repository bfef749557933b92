"""A sequence: one sample of a request, as the scheduler sees it on the CPU.

Its tokens are the prompt, the outputs already seen on the CPU, and `num_inflight` tokens being sampled by the step
now running (asynchronous scheduling feeds them to the next step as placeholders, resolved on the device side).
`num_computed_tokens` counts the tokens whose caches are computed or being computed by a scheduled step.
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from enum import Enum, auto
from itertools import count, islice
from typing import TYPE_CHECKING

from deepinfer.outputs import Logprob
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.speculator import Proposal

PLACEHOLDER = -1  # an input token still being sampled by the step in flight


class Outputs(SequenceABC):
    """The first `count` outputs of a sequence read in place from its list of outputs, then `extra` tokens. That list
    only grows (the CPU side appends to it while a step scheduled before runs), so its first `count` stay as they
    were: a step's sampling rows hold this instead of a copy, which would cost each row O(length) a step. `+` gives a
    list."""

    __slots__ = ("_items", "_count", "_extra")

    def __init__(self, items: list[int], count: int, extra: tuple[int, ...] = ()) -> None:
        if not 0 <= count <= len(items):
            raise ValueError(f"count {count} outside the {len(items)} outputs")
        self._items, self._count, self._extra = items, count, tuple(extra)

    def __len__(self) -> int:
        return self._count + len(self._extra)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.tolist()[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"output {i} of {n}")
        return self._items[i] if i < self._count else self._extra[i - self._count]

    def __iter__(self) -> Iterator[int]:
        yield from islice(self._items, self._count)
        yield from self._extra

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Outputs, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None

    def __add__(self, other) -> list[int]:
        return self.tolist() + list(other)

    def __radd__(self, other) -> list[int]:
        return list(other) + self.tolist()

    def tolist(self) -> list[int]:
        return self._items[: self._count] + list(self._extra)

    def then(self, *tokens: int) -> Outputs:
        """These outputs followed by `tokens`, still read in place."""
        return Outputs(self._items, self._count, self._extra + tokens)

    def __repr__(self) -> str:
        return f"Outputs({self.tolist()})"


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """Sample `index` of request `request_id`, seeded `seed`."""

    _ids = count()

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 max_model_len: int) -> None:
        self.seq_id = next(Sequence._ids)
        self.request_id, self.index = request_id, index
        self.prompt_token_ids = prompt_token_ids
        self.params, self.seed = params, seed
        self.max_tokens = min(params.max_tokens or max_model_len, max_model_len - len(prompt_token_ids))
        self.status = SequenceStatus.WAITING
        self.output_token_ids: list[int] = []
        self.num_inflight = 0
        self.num_computed_tokens = 0
        self.slot: int | None = None
        self.block_table: list[int] = []
        self.text = ""
        self.decoded = (0, "")  # (outputs, their text) where that text ended on a whole character (OutputProcessor)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.proposal: Proposal | None = None  # drafts for the next step (speculative decoding)
        # Prefix caching: the keys of its first full blocks, how many of its blocks are registered, the snapshot
        # slot its next chunk restores, the prompt tokens found cached when it first started (None: not yet), and
        # the positions waiting sequences asked it to leave snapshots at, with their keys and tags.
        self.block_keys: list[bytes] = []
        self.snapshots_asked: dict[int, tuple[bytes, int | None]] = {}
        self.num_registered_blocks = 0
        self.restore: int | None = None
        self.num_cached_tokens: int | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt, outputs and in-flight tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight

    @property
    def num_outputs(self) -> int:
        """Outputs sampled, in flight included."""
        return len(self.output_token_ids) + self.num_inflight

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_to_compute(self) -> int:
        """Tokens a step could feed now: the prompt's remainder, or the last token, unless the sequence has all the
        outputs it may have (it finishes when they are seen)."""
        if self.num_outputs >= self.max_tokens:
            return 0
        return self.num_tokens - self.num_computed_tokens

    def token_ids(self, start: int, length: int) -> list[int]:
        """Tokens start .. start + length - 1, PLACEHOLDER where still in flight. Slices the prompt and the outputs
        where the range lies, never copying either whole (a decode step asks for one token of a long sequence)."""
        end, prompt = start + length, len(self.prompt_token_ids)
        out = self.prompt_token_ids[start:end] if start < prompt else []
        if end > prompt:
            out += self.output_token_ids[max(0, start - prompt) : end - prompt]
        return out + [PLACEHOLDER] * max(0, end - prompt - len(self.output_token_ids))

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, request {self.request_id}#{self.index}, {self.status.name}, "
                f"{self.num_computed_tokens}/{self.num_tokens} computed, {self.num_inflight} in flight)")
