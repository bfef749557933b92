"""The engine: scheduler, cache manager, model runner and the loop that drives them (docs/structure.md maps it)."""

from __future__ import annotations

from deepinfer.engine.engine_args import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.model_runner import SampleRow, TokenConstraint
from deepinfer.engine.speculative import SpeculativeConfig

__all__ = ["EngineArgs", "LLMEngine", "SampleRow", "SpeculativeConfig", "TokenConstraint"]
