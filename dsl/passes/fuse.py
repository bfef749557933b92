"""Fusion: rewrite op patterns into fused ops that make one pass over memory instead of two.

Rules are (first op, second op, fused op): the fused op takes the first's inputs, then the second's others, and the
attrs of both. A pair fuses when the second is the only reader of the first's output, reads it as its first input,
and every input it leaves out (None) is one the fused op's reference has a default for.
"""

from __future__ import annotations

import inspect

from dsl.graph import Graph, Node, Value
from dsl.ops import OPS

RULES = [
    # The collapsed streams feed straight into the sub-layer's norm: read the hc streams once.
    ("hc_collapse", "rms_norm", "hc_collapse_rms_norm"),
    # A sub-layer's two outputs (the routed and the shared experts') are summed only to update the streams.
    ("add", "hc_expand", "add_hc_expand"),
    # The row ids go straight to the table gather: hashed in registers, never written.
    ("engram_hash", "engram_rows", "engram_hash_rows"),
    # A rotated kv, query or compressed entry goes straight to its cache's rounding: rotated and rounded in one pass.
    ("rope", "fp8_round", "rope_fp8_round"),
    ("rope", "fp4_round", "rope_fp4_round"),
    ("rope_entries", "fp4_round", "rope_entries_fp4_round"),
    # ... and normed just before (the window's kv, the indexer's keys): normed, rotated and rounded in one pass.
    ("rms_norm", "rope_fp8_round", "rms_norm_rope_fp8_round"),
    ("rms_norm", "rope_entries_fp4_round", "rms_norm_rope_entries_fp4_round"),
]


def _optional(op: str) -> set[int]:
    """Positions of the inputs `op`'s reference may be given as None (those with a default)."""
    params = [p for p in inspect.signature(OPS[op].reference).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {i for i, p in enumerate(params) if p.default is not p.empty}


def _readers(graph: Graph) -> dict[Value, list[Node]]:
    readers: dict[Value, list[Node]] = {}
    for node in graph.nodes:
        for v in node.inputs:
            if v is not None:
                readers.setdefault(v, []).append(node)
    return readers


# A stream update whose new streams the next mixes read: the fused op makes the streams and projects them in one pass,
# and gives them to their other readers too (`_updates_into_mixes`).
INTO_MIXES = {"hc_expand": "hc_expand_mixes", "add_hc_expand": "add_hc_expand_mixes"}


def _updates_into_mixes(graph: Graph) -> Graph:
    """Each `INTO_MIXES` update whose streams an `hc_mixes` reads first becomes, with that mixes, one node in the
    update's place with four outputs (the streams, pre, post, comb): where the mixes' other inputs (its weights) are
    defined before the update, so the fused node reads only what is defined before it."""
    readers = _readers(graph)
    order = {id(node): i for i, node in enumerate(graph.nodes)}
    absorbed: set[Node] = set()
    for node in graph.nodes:
        fused_op = INTO_MIXES.get(node.op)
        if fused_op is None:
            continue
        streams = node.outputs[0]
        mixes = [u for u in readers.get(streams, []) if u.op == "hc_mixes" and u.inputs[0] is streams]
        if len(mixes) != 1 or any(v is None or (v.producer is not None and order[id(v.producer)] > order[id(node)])
                                  for v in mixes[0].inputs[1:]):
            continue
        mix = mixes[0]
        node.op, node.inputs, node.attrs = fused_op, node.inputs + mix.inputs[1:], node.attrs | mix.attrs
        node.outputs = [streams, *mix.outputs]
        for v in mix.outputs:
            v.producer = node
        absorbed.add(mix)
    graph.nodes = [n for n in graph.nodes if n not in absorbed]
    return graph


def fuse(graph: Graph) -> Graph:
    for first_op, second_op, fused_op in RULES:
        readers = _readers(graph)
        outputs = set(graph.outputs.values())
        absorbed: set[Node] = set()
        for node in graph.nodes:
            if node.op != first_op or node.outputs[0] in outputs:
                continue
            users = readers.get(node.outputs[0], [])
            if len(users) != 1 or users[0].op != second_op or users[0].inputs[0] is not node.outputs[0]:
                continue
            second, inputs = users[0], node.inputs + users[0].inputs[1:]
            if any(v is None and i not in _optional(fused_op) for i, v in enumerate(inputs)):
                continue
            # The second node becomes the fused one in place: everything it now reads is defined before it.
            second.op, second.inputs, second.attrs = fused_op, inputs, node.attrs | second.attrs
            absorbed.add(node)
        graph.nodes = [n for n in graph.nodes if n not in absorbed]
    return _updates_into_mixes(graph)
