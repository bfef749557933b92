"""The one line that tells a user which model runs: where it came from, what it is, its size, the target."""

from __future__ import annotations

import math

from deepinfer.models import DeepseekV41Flash
from deepinfer.models.weights import expected_weights


def parameter_count(model: DeepseekV41Flash) -> int:
    """Parameters of the checkpoint's tensors, by their logical (dequantized) shapes."""
    specs = expected_weights(model.config)
    return sum(math.prod(specs[name].shape) for name in model.weights if name in specs)


def _size(count: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def describe_model(model: DeepseekV41Flash, embedded: bool) -> str:
    """`model` in words: the embedded default (with what it was trained on) or the directory it was loaded from."""
    from deepinfer.default_model import TRAINED_DESCRIPTION

    c = model.config
    shape = (f"DeepSeek-V4.1-Flash of {_size(parameter_count(model))} parameters ({c.num_hidden_layers} layers, "
             f"hidden {c.hidden_size}, {c.n_routed_experts} experts, {c.num_nextn_predict_layers} DSpark draft layers)")
    if embedded:
        return f"the embedded default, a tiny {shape} {TRAINED_DESCRIPTION}"
    where = model.model_dir if model.model_dir is not None else "a model object"
    return f"{where}: {shape}"
