"""Models declared in the DSL."""

from deepinfer.models.deepseek_v41 import DeepseekV41Flash

__all__ = ["DeepseekV41Flash"]
