"""DSpark speculative decoding in the engine: its settings, verification of drafts, and proposing the next ones.

Each step a decoding sequence feeds its last token followed by the drafts the scheduler gave it budget for; the
runner samples the target's token at every one of those positions with the request's hashed noise (the noise of a
position does not depend on drafting), keeps the drafts up to the first one that differs from the target's token,
and always gains the target's token after them. Output is therefore exactly what decoding without drafts gives,
greedy or seeded, whenever the logits of a position do not depend on how many tokens a forward holds (the engine's
batch-invariant mode). The rejected positions are taken back (`CompiledModel.rollback`), and the draft layers
propose the next drafts from the last token, each sampled with the same sampler and the noise of its position.
With a token constraint (structured outputs) each verified position is sampled under its own mask row, and drafts
are proposed under the constraint's masks and never past its end.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer import logits_processors
from deepinfer.dspark import DraftHead, block_tokens, draft_probability
from deepinfer.outputs import Logprob
from deepinfer.sampler import as_allowed, plain_sampled, sample, sample_plain, top_logprobs
from dsl.context import SequenceState

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
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        return cls(**values)


@dataclass
class Proposal:
    """A sequence's drafts for its next step and the confidence of each (given the ones before it)."""

    tokens: list[int]
    confidences: list[float]


class Drafter:
    """Verifies a step's drafts and proposes the next ones, on the runner's side."""

    def __init__(self, compiled, config: SpeculativeConfig, eos_token_ids: tuple[int, ...],
                 batch_invariant: bool) -> None:
        model_config = compiled.config
        if config.num_speculative_tokens > model_config.dspark_block_size:
            raise ValueError(f"num_speculative_tokens {config.num_speculative_tokens} exceeds the model's draft "
                             f"block of {model_config.dspark_block_size} tokens")
        self.compiled, self.config = compiled, config
        self.head = DraftHead(compiled.params, model_config, config.confidence_temperature,
                              getattr(compiled, "device", None))
        self.eos_token_ids, self.batch_invariant = eos_token_ids, batch_invariant
        self.greedy = GreedyDrafts(self.head, config.confidence)

    def propose(self, rows: list[tuple[SequenceState, object, list[int]]], fill_next=None,
                lengths: list[int] | None = None) -> list[Proposal]:
        """Drafts for sequences (state after the step, sample row, outputs so far including the step's tokens).

        `fill_next` is the token constraint's (TokenConstraint.fill_next), or None: each draft is then sampled among
        the tokens the sequence's constraint allows after the drafts before it, and a row whose drafts end or break
        the constraint drafts no further (its last draft dropped: nothing may follow it in the verification).
        `lengths`: each row's draft block (1 to num_speculative_tokens; None: that many for every row)."""
        if not rows:
            return []
        k, cfg = self.config.num_speculative_tokens, self.compiled.config
        lengths = lengths or [k] * len(rows)
        if len(lengths) != len(rows) or not all(1 <= n <= k for n in lengths):
            raise ValueError(f"draft lengths must be 1 to {k}, one a row: got {lengths} for {len(rows)} rows")
        batch = [(state, block_tokens(outputs[-1], cfg, n)) for (state, _, outputs), n in zip(rows, lengths)]
        hidden, logits = self.compiled.draft(batch, **({"batch_invariant": True} if self.batch_invariant else {}))
        hidden, logits = _blocks(hidden, lengths, k), _blocks(logits, lengths, k)
        with self.compiled.sampling():
            drafts = self._drafts(rows, hidden, logits, fill_next, lengths)
        return [Proposal(p.tokens[:n], p.confidences[:n]) for p, n in zip(drafts, lengths, strict=True)]

    def _drafts(self, rows, hidden: torch.Tensor, logits: torch.Tensor, fill_next,
                lengths: list[int]) -> list[Proposal]:
        """Each row's drafts and confidences from its draft block's hidden states and logits [rows, k, ...]: up to
        its length (the greedy path drafts all k of every row, which `propose` cuts)."""
        k = hidden.shape[1]
        drafts: list[list[int]] = [[] for _ in rows]
        live = [True] * len(rows)
        device = hidden.device
        previous = torch.tensor([outputs[-1] for _, _, outputs in rows], device=device)
        samples = [s for _, s, _ in rows]
        masks = fill_next(samples, drafts) if fill_next is not None else None  # None: no row is constrained
        if masks is None and all(plain_greedy(s, outputs) for _, s, outputs in rows):
            picks, confidences = self.greedy(hidden, logits, previous)  # every row's argmax, read back once
            return [Proposal(d, c) for d, c in zip(picks.tolist(), confidences.tolist(), strict=True)]
        if masks is None and all(plain_greedy(s, outputs) or plain_sampled(s.params, len(outputs), logits.shape[-1])
                                 for _, s, outputs in rows):
            return self._plain_drafts(rows, hidden, logits, previous)
        confidences = torch.zeros(len(rows), k, device=device)  # positions a row does not draft keep 0
        for i in range(k + 1):  # the check after the last draft only drops it if it ends the constraint
            if i and fill_next is not None:
                masks = fill_next(samples, drafts)
            allowed = as_allowed(masks, logits.shape[-1])
            for r, d in enumerate(drafts):  # a row allowing nothing: its drafts end the constraint, or break it
                if allowed is not None and live[r] and not allowed[r].any():
                    live[r] = False
                    if d:
                        d.pop()
            if i == k:
                break
            emb, markov = self.head.markov(previous)
            if self.config.confidence == "head":
                confidences[:, i] = self.head.confidence(hidden[:, i], emb)
            for r, (_, s, outputs) in enumerate(rows):
                if not live[r] or i >= lengths[r]:
                    continue
                row_logits = logits[r, i] + markov[r]
                if allowed is not None:
                    row_logits = row_logits.masked_fill(~allowed[r], float("-inf"))
                seen = outputs + drafts[r]
                drafts[r].append(sample(row_logits, s.params, s.seed, len(s.prompt_token_ids) + len(seen), seen,
                                        s.prompt_token_ids, self.eos_token_ids))
                if self.config.confidence == "draft":
                    token = torch.tensor([drafts[r][-1]], device=row_logits.device)
                    confidences[r, i] = draft_probability(row_logits[None], token)[0]
            previous = torch.tensor([d[-1] if d else outputs[-1] for d, (_, _, outputs) in zip(drafts, rows)],
                                    device=device)
        return [Proposal(d, c[: len(d)]) for d, c in zip(drafts, confidences.tolist(), strict=True)]

    def _plain_drafts(self, rows, hidden: torch.Tensor, logits: torch.Tensor,
                      previous: torch.Tensor) -> list[Proposal]:
        """`_drafts` for rows that each sample greedily or from their scaled logits alone (`plain_sampled`): the
        greedy drafts' loop, the sampled rows' picks of each position drawn at once by `sample_plain` (at the
        positions `sample` would use), all k of every row, read back once."""
        sampled = [r for r, (_, s, outputs) in enumerate(rows) if not plain_greedy(s, outputs)]
        temperatures = [rows[r][1].params.temperature for r in sampled]
        seeds = [rows[r][1].seed for r in sampled]
        first = [len(rows[r][1].prompt_token_ids) + len(rows[r][2]) for r in sampled]
        index = torch.tensor(sampled, device=hidden.device)

        def draw(i: int, scores: torch.Tensor, picks: torch.Tensor) -> torch.Tensor:
            picks[index] = sample_plain(scores[index], temperatures, seeds, [p + i for p in first])
            return picks

        picks, confidences = self.greedy.run(hidden, logits, previous, draw)
        return [Proposal(d, c) for d, c in zip(picks.tolist(), confidences.tolist(), strict=True)]


def _blocks(values: torch.Tensor, lengths: list[int], k: int) -> torch.Tensor:
    """A draft pass's rows [sum(lengths), ...] as [len(lengths), k, ...], each block's rows first and zeros after
    them (positions past a block are drafted from and then dropped)."""
    if all(n == k for n in lengths):
        return values.reshape(len(lengths), k, -1)
    out = values.new_zeros(len(lengths), k, values.shape[-1])
    mask = torch.arange(k)[None, :] < torch.tensor(lengths)[:, None]
    out[mask.to(values.device)] = values
    return out


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


def step_picks(logits: torch.Tensor, rows: list[tuple[object, list[int], range]]) -> list[int] | None:
    """Every row of a step's logits [R, V] as `sample` would pick it, read back once, for the sequences whose tokens
    allow it: `rows` (sample row, outputs so far, its logits rows). A plain greedy sequence's rows get their argmax,
    a plain sampled one's their draw (position by position, as `verify` samples them), all in one `sample_plain`;
    the other rows hold their argmax, which `verify` does not use for them. None when no sequence is either."""
    num_rows, vocab = logits.shape
    temperatures, seeds, positions = [0.0] * num_rows, [0] * num_rows, [0] * num_rows  # temperature 0: the argmax
    found = False
    for s, outputs, r in rows:
        if plain_greedy(s, outputs):
            found = True
        elif plain_sampled(s.params, len(outputs), vocab):
            found = True
            first = len(s.prompt_token_ids) + len(outputs)
            for k, i in enumerate(r):
                temperatures[i], seeds[i], positions[i] = s.params.temperature, s.seed, first + k
    return sample_plain(logits, temperatures, seeds, positions).tolist() if found else None


def plain_greedy(sample_row, outputs: list[int]) -> bool:
    """Whether `sample` picks a row's every next token as the plain argmax of its logits: greedy, no penalty, no
    token banned by min_tokens any more, no log-probabilities asked for, no processor of the request's own."""
    p = sample_row.params
    return (p.is_greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and len(outputs) >= p.min_tokens and p.logprobs is None and not logits_processors.acts(p))


def verify(logits: torch.Tensor, allowed: torch.Tensor | None, sample_row, outputs: list[int], drafts: list[int],
           eos_token_ids: tuple[int, ...], picks: list[int] | None = None,
           ) -> tuple[list[int], list[dict[int, Logprob] | None]]:
    """The tokens a step gives a sequence that fed its last token then `drafts`: the target's token at every
    position up to and including the first that differs from its draft (just the one token without drafts).
    `logits` [len(drafts) + 1, vocab]; `allowed` (bool, same shape) the constraint's mask of each position, or
    None; `picks`, if the caller read them back for the whole step at once, each row's token as `sample` draws it
    (`step_picks`: a plain greedy row's argmax, a plain sampled row's draw).
    Log-probabilities, when asked for, are of the raw logits (before mask and penalties)."""
    s = sample_row
    n = len(drafts) + 1
    targets = None
    if allowed is None and plain_greedy(s, outputs):  # every position's argmax in one read back
        targets = picks if picks is not None else torch.argmax(logits[:n], dim=-1).tolist()
    elif allowed is None and picks is not None and plain_sampled(s.params, len(outputs), logits.shape[-1]):
        targets = picks
    if targets is not None:
        kept = next((j for j, (t, d) in enumerate(zip(targets, drafts)) if t != d), len(drafts))
        return targets[: kept + 1], [None] * (kept + 1)
    tokens, logprobs = [], []
    for j in range(len(drafts) + 1):
        seen = outputs + tokens
        row = logits[j] if allowed is None else logits[j].masked_fill(~allowed[j], float("-inf"))
        token = sample(row, s.params, s.seed, len(s.prompt_token_ids) + len(seen), seen, s.prompt_token_ids,
                       eos_token_ids)
        tokens.append(token)
        logprobs.append(top_logprobs(logits[j], token, s.params.logprobs) if s.params.logprobs is not None else None)
        if j == len(drafts) or token != drafts[j]:
            break
    return tokens, logprobs
