"""DSpark's settings: `LLM(speculative_config={...})`, checked field by field."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SCHEDULES = ("confidence", "static")
DRAFT_LENGTHS = ("fixed", "adaptive")
CONFIDENCES = ("head", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`LLM(speculative_config={...})`.

    - `method`: "dspark" (the model's draft layers).
    - `num_speculative_tokens`: drafts proposed per step, at most the model's `dspark_block_size`.
    - `schedule`: "confidence" gives the step's spare budget to the drafts with the highest cumulative products of
      confidences (a request verifies 0 to `num_speculative_tokens`); "static" verifies `num_speculative_tokens`
      drafts per request while the budget lasts (for comparison).
    - `verify_budget`: tokens per step for the decoding requests (each gets one, drafts share the rest); None: the
      scheduler's `max_num_batched_tokens`.
    - `confidence`: what a draft's confidence is: "head", the model's confidence head (its estimate that the draft
      is accepted given the ones before it), or "draft", the draft distribution's probability of the drafted token.
    - `confidence_temperature`: the confidence head's sigmoid temperature.
    - `draft_lengths`: "fixed" drafts `num_speculative_tokens` for every request each step; "adaptive" sizes each
      request's draft block by its last verification: two more than the drafts it accepted, at most
      `num_speculative_tokens` (the full count until it has verified some), so the draft pass spends less on
      requests whose drafts fail early.
    """

    method: str = "dspark"
    num_speculative_tokens: int = 5
    schedule: str = "confidence"
    verify_budget: int | None = None
    confidence_temperature: float = 1.0
    draft_lengths: str = "fixed"
    confidence: str = "head"

    def __post_init__(self) -> None:
        if self.method != "dspark":
            raise ValueError(f"speculative_config method must be 'dspark' (the model's draft layers), "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"speculative_config schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        b = self.verify_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"verify_budget must be an integer >= 1 or None, got {b!r}")
        t = self.confidence_temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t > 0:
            raise ValueError(f"confidence_temperature must be a number > 0, got {t!r}")
        if self.confidence not in CONFIDENCES:
            raise ValueError(f"speculative_config confidence must be one of {CONFIDENCES}, got {self.confidence!r}")
        if self.draft_lengths not in DRAFT_LENGTHS:
            raise ValueError(f"speculative_config draft_lengths must be one of {DRAFT_LENGTHS}, "
                             f"got {self.draft_lengths!r}")

    def next_length(self, previous: int | None, verified: int, accepted: int) -> int:
        """A request's draft block for its next step, after it verified `verified` drafts and accepted `accepted`
        of them; `previous`: its block this step (None: it has none yet)."""
        k = self.num_speculative_tokens
        if self.draft_lengths == "fixed":
            return k
        return min(k, accepted + 2) if verified else (k if previous is None else previous)

    @classmethod
    def from_dict(cls, values: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From `LLM`'s `speculative_config` dict (None: no drafting); unknown keys are an error."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            # ValueError as for every other bad field, so callers catch one type
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")  # noqa: TRY004
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**values)
