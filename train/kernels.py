"""Op overrides that make the interpreter's graph trainable, passed to `interpret(..., kernels=...)`.

- The cache roundings (`fp8_round`, `fp4_round`) are straight-through: the forward is the reference's value, bit
  for bit, and the backward is the identity.
- The sparse indexer gets a training signal of its own, as DeepSeek-V3.2 trains its lightning indexer: at every
  index-source layer, the KL divergence from the attention's distribution over the selected compressed entries
  (summed over heads, detached) to the softmax of the index scores over the same entries. The indexer's inputs are
  detached (its `linear`s see detached activations), so that loss trains only the indexer and the LM loss leaves
  it alone: the top-k selection passes no gradient anyway.
- The MoE gates' picks are counted, for the auxiliary-loss-free balancing of the selection biases.
- The ops that loop over a forward's chunks run batched when the forward is a training batch (train/batched.py);
  the draft layers' windows come from `draft_windows`, which train/draft.py gathers from the backbone's main keys.

Everything else runs the reference unchanged.
"""

from __future__ import annotations

import torch

from dsl.ops import OPS
from dsl.ragged import Ragged
from train import batched

_INDEXER_WEIGHTS = (".indexer.wq_b.weight", ".indexer.weights_proj.weight", ".indexer.wk.weight")


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
        return rounded

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def straight_through(reference):
    """`reference`'s value in the forward, the identity in the backward (Ragged inputs keep their layout)."""

    def run(x, *args, **kwargs):
        if isinstance(x, Ragged):
            return x.replace(run(x.values, *args, **kwargs))
        with torch.no_grad():
            rounded = reference(x.detach(), *args, **kwargs)
        return _StraightThrough.apply(x, rounded) if x.requires_grad else rounded

    return run


def _detached(x):
    return x.replace(x.values.detach()) if isinstance(x, Ragged) else x.detach()


def indexer_kl(scores: torch.Tensor, mass: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sum over queries of KL(attention mass over the picked entries || softmax of their index scores), and the
    number of queries counted. scores [B * T, L]; mass and chosen [B, T, L]."""
    scores = scores.reshape(mass.shape)
    rows = chosen.any(-1) & (mass.sum(-1) > 0)  # [B, T]: queries that attended to some entry
    s, keep, target = scores[rows], chosen[rows], mass[rows]
    target = target / target.sum(-1, keepdim=True)
    log_q = torch.log_softmax(s.masked_fill(~keep, float("-inf")), dim=-1).masked_fill(~keep, 0.0)
    terms = torch.where(keep & (target > 0), target * (target.clamp_min(1e-30).log() - log_q), 0.0)
    return terms.sum(), int(rows.sum())


class TrainingKernels:
    """The override table plus what it records during one forward: indexer losses and expert loads."""

    def __init__(self, params: dict[str, torch.Tensor], draft_first_layer: int, indexer_loss: bool = True) -> None:
        """`draft_first_layer`: the cache layer id of the first draft layer (num_hidden_layers)."""
        self.draft_first_layer = draft_first_layer
        self.indexer_ids = {id(t) for name, t in params.items() if name.endswith(_INDEXER_WEIGHTS)}
        self.indexer_loss = indexer_loss
        self.kernels = {"fp8_round": straight_through(OPS["fp8_round"].reference),
                        "fp4_round": straight_through(OPS["fp4_round"].reference),
                        "linear": self._linear, "moe_gate": self._moe_gate, "index_scores": self._index_scores,
                        "sparse_attention": self._sparse_attention, "kv_window_append": batched.kv_window_append,
                        "cache_append": batched.cache_append, "compress_pool": batched.compress_pool,
                        "engram_ngrams": batched.engram_ngrams, "kv_window_store": batched.kv_window_store,
                        "kv_window_block": self._kv_window_block}
        self.draft_windows: tuple[torch.Tensor, torch.Tensor] | None = None  # set by train/draft.py per forward
        self.reset()

    def reset(self) -> None:
        self.kl_sum: torch.Tensor | float = 0.0
        self.kl_rows = 0
        self.loads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (gate bias, picks per expert)
        self._scores: torch.Tensor | None = None

    def _linear(self, x, w, scale=None):
        if id(w) in self.indexer_ids:
            x = _detached(x)
        return OPS["linear"].reference(x, w, scale)

    def _moe_gate(self, x, w, bias, **attrs):
        weights, experts = OPS["moe_gate"].reference(x, w, bias, **attrs)
        self.loads.append((bias, torch.bincount(experts.flatten(), minlength=bias.shape[0])))
        return weights, experts

    def _index_scores(self, *args, **kwargs):
        self._scores = batched.index_scores(*args, **kwargs)
        return self._scores

    def _sparse_attention(self, q, window, sink, compressed=None, topk=None, **kwargs):
        out, mass = batched.sparse_attention(q, window, sink, compressed, topk, **kwargs)
        if self._scores is not None and mass is not None and self.indexer_loss:
            kl, rows = indexer_kl(self._scores, *mass)
            self.kl_sum, self.kl_rows = self.kl_sum + kl, self.kl_rows + rows
        self._scores = None  # this layer's selection is scored; the next layers reuse it
        return out

    def _kv_window_block(self, kv, *, layer: int, window: int, ctx):
        if self.draft_windows is None:
            return OPS["kv_window_block"].reference(kv, layer=layer, window=window, ctx=ctx)
        keys, valid = self.draft_windows
        return batched.kv_window_block(kv, keys[:, layer - self.draft_first_layer], valid)

    def indexer_loss_value(self) -> torch.Tensor | float:
        return self.kl_sum / max(self.kl_rows, 1)

    @torch.no_grad()
    def balance(self, rate: float, only: set[int] | None = None) -> None:
        """Nudge each gate's selection bias toward equal loads: up for under-used experts, down for over-used.
        `only`: the ids of the biases to balance (default: every gate's)."""
        for bias, counts in self.loads:
            if only is not None and id(bias) not in only:
                continue
            counts = counts.float()
            bias += rate * torch.sign(counts.mean() - counts)
