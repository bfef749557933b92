"""DSpark speculative decoding, plugged into the engine as its `Speculator` (deepinfer/engine/speculator.py)."""

from __future__ import annotations

from deepinfer.engine.spec_decode.config import SpeculativeConfig
from deepinfer.engine.spec_decode.dspark_speculator import DSparkSpeculator

__all__ = ["DSparkSpeculator", "SpeculativeConfig"]
