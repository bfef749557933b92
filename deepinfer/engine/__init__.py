"""The engine: scheduler, cache manager, model runner and the loop that drives them (docs/structure.md maps it).

DSpark drafting plugs in as a `Speculator` (deepinfer/engine/spec_decode/); its `SpeculativeConfig` loads from here
on first use, so the engine without drafting never imports it.
"""

from __future__ import annotations

from deepinfer.engine.engine_args import EngineArgs
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.sampler import SampleRow
from deepinfer.engine.speculator import Proposal, Speculator
from deepinfer.engine.token_constraint import TokenConstraint

__all__ = ["EngineArgs", "LLMEngine", "Proposal", "SampleRow", "SpeculativeConfig", "Speculator", "TokenConstraint"]


def __getattr__(name: str):
    if name == "SpeculativeConfig":
        from deepinfer.engine.spec_decode import SpeculativeConfig

        return SpeculativeConfig
    raise AttributeError(f"module 'deepinfer.engine' has no attribute {name!r}")
