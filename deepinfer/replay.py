"""Sliding-window bounded replay (`swa_replay_tokens`): where its boundary lies in a model, and its settings' checks.

The decoder layers (from the first layer of compress ratio 1 on) read the compressed KV their KV source builds and
own only their sliding windows, so a prefill can run them over each sequence's last `swa_replay_tokens` tokens
(`SequenceState.replay_from`, dsl/ops/replay.py): the boundary layer's compressor and indexer keys still run over
every token, from its full-length input. A defined approximation, not the exact forward; off by default.
The boundary takes the DSpark features of the target layers before it to the kept rows with the streams, so the
target layers may lie on both sides of it (the embedded checkpoint's do), and the draft layers' main keys cover the
kept positions, which hold every window a draft reads.

A sequence's replay position is fixed by its prompt (`replay_from`): every prefill of it, a recompute after preemption
included, runs the decoder layers from the same position, so its outputs do not depend on whether or when it was
preempted (nor on what it was batched with). Prefix caching combines with it through the snapshots' replay positions
(deepinfer/engine/prefix_cache.py): a hit resumes only where the decoder windows it restores are those the sequence
computes itself.
"""

from __future__ import annotations

from deepinfer.config import DeepseekV41Config


def boundary_layer(config: DeepseekV41Config) -> int:
    """The first decoder layer (compress ratio 1), which must be the last KV source, with every Engram layer before
    it: the rows after the boundary have neither a full-length input for a compressor nor an n-gram history."""
    ratios = config.compress_ratios[: config.num_hidden_layers]
    if 1 not in ratios:
        raise ValueError(f"swa_replay_tokens needs decoder layers (compress ratio 1); compress_ratios is "
                         f"{list(ratios)}")
    boundary = ratios.index(1)
    later_sources = [s for s in config.kv_source_layer_ids if s > boundary]
    if later_sources:
        raise ValueError(f"swa_replay_tokens: KV sources {later_sources} come after the first decoder layer "
                         f"({boundary}), and their compressors need every token's input")
    late_engram = [i for i in config.engram_layer_ids if i >= boundary]
    if late_engram:
        raise ValueError(f"swa_replay_tokens: Engram layers {late_engram} are at or after the first decoder layer "
                         f"({boundary}); bounded replay needs every Engram layer before it")
    return boundary


def replay_from(num_prompt_tokens: int, swa_replay_tokens: int | None) -> int:
    """The first position at which the decoder layers run in every prefill of a sequence with this many prompt
    tokens: its prompt's last `swa_replay_tokens` (0: replay off, or a prompt no longer than that). A recompute after
    preemption starts there too, over the outputs as well: the decoder windows it rebuilds are then bit for bit those
    the sequence had (batch-invariant mode), so preemption does not change its outputs."""
    return 0 if swa_replay_tokens is None else max(0, num_prompt_tokens - swa_replay_tokens)


def check_replay_tokens(config: DeepseekV41Config, swa_replay_tokens: int | None, num_speculative_tokens: int) -> None:
    """Raise ValueError unless bounded replay can run with these settings (None: off, nothing to check). The kept
    tokens must cover a window and the longest draft's backtrack, so a decode step or a rejected draft never reaches
    a window position the replay skipped."""
    if swa_replay_tokens is None:
        return
    boundary_layer(config)
    least = config.sliding_window + num_speculative_tokens + 1
    if swa_replay_tokens < least:
        raise ValueError(f"swa_replay_tokens={swa_replay_tokens} is below sliding_window + num_speculative_tokens + 1 "
                         f"= {config.sliding_window} + {num_speculative_tokens} + 1 = {least}")


__all__ = ["boundary_layer", "check_replay_tokens", "replay_from"]
