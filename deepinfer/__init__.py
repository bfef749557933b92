"""DeepInfer: an offline inference engine and compiler for DeepSeek-V4.1-Flash."""

from __future__ import annotations

from deepinfer import models
from deepinfer.compile import compile  # the public name, as torch.compile
from deepinfer.sampling_params import SamplingParams

# `load` (running a saved artifact) joins this list with the artifact format.
__all__ = ["LLM", "SamplingParams", "compile", "models"]


def __getattr__(name: str):
    # `LLM` is resolved on first use: it brings in the tokenizer and the progress bar, which compiling does not need.
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
