"""The DSL: tensor types over symbolic dims, the op table with reference semantics, graphs, passes."""

from dsl.builder import GraphBuilder
from dsl.context import ForwardContext, SequenceState
from dsl.graph import Graph, Node, Value
from dsl.interpret import interpret
from dsl.ops import OPS
from dsl.passes import run_passes
from dsl.tensor import TensorType, context, num_entries, num_tokens

__all__ = ["GraphBuilder", "ForwardContext", "SequenceState", "Graph", "Node", "Value", "interpret", "OPS",
           "run_passes", "TensorType", "num_tokens", "num_entries", "context"]
