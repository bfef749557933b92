"""A model compiled for a GPU target (sm90, sm100): its plan and cubins; saved as an artifact, or run.

`deepinfer.compile(model, target="sm90")` returns one; `.save(dir)` writes the artifact (graphs/artifact.py);
`deepinfer.load(dir)` reads one back and runs it with torch and the CUDA driver alone (cubins launched through
`graphs.launcher`, never compiled again). `forward` and `step` match `CompiledModel`'s.
"""

from __future__ import annotations

import torch

from deepinfer.config import DeepseekV41Config
from dsl.context import ForwardContext, SequenceState
from dsl.graph import Graph
from graphs import artifact
from graphs.aot import Built
from graphs.plan import Plan
from kernels.launch import use_launcher


class GpuCompiledModel:
    def __init__(self, config: DeepseekV41Config, graph: Graph, plan: Plan, specs: dict[str, dict],
                 cubins: dict[str, bytes], params: dict[str, torch.Tensor], model_dir: str | None = None,
                 built: dict[str, Built] | None = None) -> None:
        self.config, self.graph, self.plan = config, graph, plan
        self.target = plan.target
        self.specs, self.cubins, self.params, self.model_dir = specs, cubins, params, model_dir
        self._built = built
        self._executor = None
        self._launcher = None

    def save(self, path) -> None:
        """Write the artifact: manifest.json, plan.json, tuning.json, kernels/*.cubin with launch specs."""
        if self._built is None:
            raise ValueError("only a freshly compiled model can be saved; a loaded one is already on disk")
        artifact.save(path, self.plan, self._built, self.config.to_dict(), self.model_dir)

    def _ready(self):
        if self.target != "sm90":
            raise RuntimeError(f"a {self.target} artifact runs on a {self.target} GPU; this build runs sm90 only")
        if not torch.cuda.is_available():
            raise RuntimeError("running a GPU artifact needs a CUDA device")
        if self._executor is None:
            from graphs.executor import Executor
            from graphs.launcher import CubinLauncher

            self._launcher = CubinLauncher(self.specs, self.cubins)
            self._executor = Executor(self.graph, self.plan, self.params, "cuda")
        return self._executor

    def new_sequence(self) -> SequenceState:
        return SequenceState()

    @torch.inference_mode()
    def step(self, batch: list[tuple[SequenceState, list[int]]], all_logits: bool = False,
             batch_invariant: bool = False) -> torch.Tensor:
        """One chunk of tokens per sequence; fp32 logits of each chunk's last token (or of every token)."""
        if batch_invariant:
            # The GPU kernels pick split-K and split-over-entries counts per token bucket, so a row's reduction
            # order can change with the batch: refuse rather than promise what is not held.
            raise NotImplementedError(f"batch-invariant kernels are not built for {self.target} yet: pass "
                                      "batch_invariant=False")
        executor = self._ready()
        lengths = [len(tokens) for _, tokens in batch]
        if any(n == 0 for n in lengths):
            raise ValueError("every sequence in a step needs at least one token")
        ids = torch.tensor([t for _, tokens in batch for t in tokens], dtype=torch.long, device="cuda")
        rows = None if all_logits else (torch.tensor(lengths).cumsum(0) - 1).cuda()
        ctx = ForwardContext([s for s, _ in batch], lengths, device="cuda", logit_rows=rows)
        with use_launcher(self._launcher):
            logits = executor.run({"input_ids": ids}, ctx)["logits"]
        ctx.commit()
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32) of B fresh sequences of T tokens each."""
        batch, tokens = input_ids.shape
        logits = self.step([(self.new_sequence(), row.tolist()) for row in input_ids], all_logits=True)
        return logits.reshape(batch, tokens, -1)


def load(path, model=None) -> GpuCompiledModel:
    """Read an artifact saved by `compile(...).save(path)`. The weights come from `model` (a DeepseekV41Flash),
    else from the checkpoint directory the artifact names."""
    from deepinfer.models.deepseek_v41 import DeepseekV41Flash
    from dsl.passes import run_passes

    manifest, plan, specs, cubins = artifact.read(path)
    if model is None:
        if not manifest.get("model_dir"):
            raise ValueError(f"{path} names no checkpoint: pass the model")
        model = DeepseekV41Flash.from_pretrained(manifest["model_dir"])
    if artifact.config_hash(model.config.to_dict()) != manifest["model_config_hash"]:
        raise ValueError(f"{path} was compiled for another model config")
    graph = run_passes(model.graph())
    plan.check_graph(graph)
    return GpuCompiledModel(model.config, graph, plan, specs, cubins, model.params(), model.model_dir)


__all__ = ["GpuCompiledModel", "load"]
