"""DeepInfer: an offline inference engine and compiler for DeepSeek-V4.1-Flash."""

from __future__ import annotations

from deepinfer import models
from deepinfer.compile import compile, load  # `compile`: the public name, as torch.compile
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "compile", "load", "models"]


def __getattr__(name: str):
    # `LLM` is resolved on first use: it brings in the tokenizer and the progress bar, which compiling does not need.
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
