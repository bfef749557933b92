"""DeepInfer: an offline inference engine and compiler for DeepSeek-V4.1-Flash."""

from __future__ import annotations

import importlib

from deepinfer import models
from deepinfer.compile import compile, load  # `compile`: the public name, as torch.compile
from deepinfer.default_model import default_checkpoint
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling_params import SamplingParams
from deepinfer.structured_outputs import StructuredOutputsParams

__all__ = ["LLM", "BeamSearchParams", "CompletionOutput", "EngineArgs", "Logprob", "RequestOutput", "SamplingParams",
           "StructuredOutputsParams", "TextPrompt", "TokensPrompt", "compile", "default_checkpoint", "load", "models"]

# Resolved on first use: they bring in the engine, the tokenizer and the progress bar, which compiling does not need.
_LAZY = {"LLM": "deepinfer.llm", "BeamSearchParams": "deepinfer.beam_search", "EngineArgs": "deepinfer.engine",
         "TextPrompt": "deepinfer.inputs", "TokensPrompt": "deepinfer.inputs"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
