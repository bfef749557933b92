"""A model compiled for a GPU target (sm90, sm100): its plan and cubins; saved as an artifact, or run.

`deepinfer.compile(model, target=...)` with a GPU target returns one; `.save(dir)` writes the artifact
(graphs/artifact.py); `deepinfer.load(dir)` reads one back and runs it with torch and the CUDA driver alone (cubins
launched through `graphs.launcher`, never compiled again). `forward` and `step` match `CompiledModel`'s.

`step(..., batch_invariant=True)` runs every kernel node with its plan's batch-invariant config (graphs/plan.py)
and the reference nodes whose picks depend on the batch's widths (the indexer's block and top-k selection, in
artifacts planned before their kernels, kernels/triton/topk.py), or whose sums CUDA splits by size (Engram's gate, the
compressor's pooling), with the cpu target's invariant versions (deepinfer/batch_invariant.py), which are plain torch
on any device. The
indexer's scores run on their kernel (kernels/triton/indexer.py), whose order is fixed per entry; its key projection
over the compressed entries still runs as a torch reference whose rounding can follow the batch: the keys only choose
entries, so a row can differ only where two entries' scores tie that closely.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

import kernels.cache.rows as cache_kernels
import kernels.sampling.gumbel_argmax as sampling_kernels
from deepinfer.compiled import CompiledModel
from deepinfer.config import DeepseekV41Config
from dsl.context import ForwardContext, SequenceState
from dsl.graph import Graph
from dsl.ops import OPS, invariant_references
from dsl.transfer import host_to, to_device
from graphs import artifact
from graphs.aot import Built
from graphs.plan import Plan
from kernels.launch import use_launcher
from kernels.targets import cubin_targets, get_target

# Reference nodes of batch-invariant steps run their op's batch-invariant reference where it holds on a GPU (dsl/ops).
INVARIANT_REFERENCES = invariant_references(anywhere=True)
# The draft blocks' attention in artifacts planned before the kernel served it (every query over its block's whole
# view): all of a forward's blocks at once in torch.
DRAFT_REFERENCES = {"sparse_attention": OPS["sparse_attention"].invariant}


class GpuCompiledModel:
    """`draft`, when compiled with DSpark drafting, is the draft layers' graph and plan: `step` then also writes their
    main keys, `draft()` runs them and `rollback()` takes back rejected tokens, as on the cpu target."""

    def __init__(self, config: DeepseekV41Config, graph: Graph, plan: Plan, specs: dict[str, dict],
                 cubins: dict[str, bytes], params: dict[str, torch.Tensor], model_dir: str | None = None,
                 built: dict[str, Built] | None = None, draft: tuple[Graph, Plan] | None = None,
                 cuda_graphs: bool | None = None) -> None:
        self.config, self.graph, self.plan = config, graph, plan
        if cuda_graphs is None:
            cuda_graphs = os.environ.get("DEEPINFER_CUDA_GRAPHS", "1") != "0"
        self._cuda_graphs = cuda_graphs
        self._ahead = 0  # decode tokens whose buckets are captured ahead (`capture_ahead`)
        self.target = plan.target
        self.specs, self.cubins, self.model_dir = specs, cubins, model_dir
        self.draft_graph, self.draft_plan = draft if draft is not None else (None, None)
        self.device = torch.device("cuda")
        self._host_params = params
        self._built = built
        self._executors = None
        self._launcher = None
        # whether the pools store and load entries with the cache kernels: artifacts built before them use torch
        self.cache_kernels = all(any(k.startswith(f"{name}(") for k in specs) for name in cache_kernels.KERNEL_NAMES)
        # whether the engine's draws launch the sampling kernel's cubins: artifacts built before them use the JIT
        self.sampling_kernels = all(any(k.startswith(f"{name}(") for k in specs)
                                    for name in sampling_kernels.KERNEL_NAMES)

    @property
    def cuda_graphs(self) -> bool:
        """Whether steps of up to 512 tokens replay their static segments as CUDA graphs (graphs/capture.py): on by
        default, `DEEPINFER_CUDA_GRAPHS=0` turns it off. Setting it drops any graphs captured so far."""
        return self._cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        from graphs.capture import CudaGraphs

        self._cuda_graphs = bool(on)
        for executor in self._executors or ():
            if executor is not None:
                executor.cuda_graphs = CudaGraphs(executor.graph, ahead=self._ahead) if on else None

    def capture_ahead(self, tokens: int) -> None:
        """Capture the graphs of every bucket up to `tokens` (the most a decode step runs) when the first is
        captured, largest first, in one memory pool (graphs/capture.py); the engine sets it from its batch size."""
        self._ahead = tokens
        for executor in self._executors or ():
            if executor is not None and executor.cuda_graphs is not None:
                executor.cuda_graphs.ahead = tokens

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The weights, on the GPU once the model has run (on the host before)."""
        return self._executors[0].params if self._executors is not None else self._host_params

    def save(self, path) -> None:
        """Write the artifact: manifest.json, plan.json (draft_plan.json too with drafting), tuning.json,
        kernels/*.cubin with launch specs."""
        if self._built is None:
            raise ValueError("only a freshly compiled model can be saved; a loaded one is already on disk")
        artifact.save(path, self.plan, self._built, self.config.to_dict(), self.model_dir, self.draft_plan)

    def _ready(self):
        """(main executor, draft executor or None), made on first use."""
        if not get_target(self.target).runnable:
            runnable = ", ".join(t.name for t in cubin_targets() if t.runnable)
            raise RuntimeError(f"a {self.target} artifact runs on a {self.target} GPU; this build runs {runnable} only")
        if not torch.cuda.is_available():
            raise RuntimeError("running a GPU artifact needs a CUDA device")
        if self._executors is None:
            from graphs.executor import Executor
            from graphs.launcher import CubinLauncher

            self._launcher = CubinLauncher(self.specs, self.cubins)
            main = Executor(self.graph, self.plan, self._host_params, "cuda", cuda_graphs=self._cuda_graphs)
            draft = None
            if self.draft_graph is not None:  # the same weights on the device, converted once for both
                draft = Executor(self.draft_graph, self.draft_plan, main.params, "cuda", formatted=main.formatted,
                                 cuda_graphs=self._cuda_graphs)
            self._executors = (main, draft)
            self.capture_ahead(self._ahead)
        return self._executors

    def new_sequence(self) -> SequenceState:
        return SequenceState()

    @contextlib.contextmanager
    def _pools(self, states: list[SequenceState]) -> Iterator[None]:
        """For one step: the pools of `states` store and load cache entries with the cache kernels
        (kernels/triton/cache.py: one launch where torch makes some hundred), bit for bit as their torch path."""
        pools = {id(s.cache): s.cache for s in states if s.cache is not None} if self.cache_kernels else {}
        kept = {key: (cache.writer, cache.reader) for key, cache in pools.items()}
        for cache in pools.values():
            cache.writer, cache.reader = cache_kernels.store_rows, cache_kernels.load_rows
        try:
            yield
        finally:
            for key, cache in pools.items():
                cache.writer, cache.reader = kept[key]

    def sampling(self) -> contextlib.AbstractContextManager:
        """What the engine samples in: `sample_plain` launches the sampling kernel (kernels/triton/sampling.py) from the
        artifact's cubins, built for fp32 logits of the config's vocabulary as `step` returns them, no Triton needed.
        An artifact built before them leaves launches as they are (Triton's JIT, or torch where Triton is missing)."""
        if not self.sampling_kernels or self._launcher is None:  # no step has run yet: nothing to sample
            return contextlib.nullcontext()
        return use_launcher(self._launcher)

    @torch.inference_mode()
    def step(self, batch: list[tuple[SequenceState, list[int]]], all_logits: bool = False,
             batch_invariant: bool = False, num_logits: list[int] | None = None) -> torch.Tensor:
        """One chunk of tokens per sequence; fp32 logits of each chunk's last token, of the last `num_logits[i]`
        tokens of chunk i, or of every token (`all_logits`). With `batch_invariant` each row's logits are bitwise
        independent of the batch and of chunking."""
        executor, _ = self._ready()
        lengths = [len(tokens) for _, tokens in batch]
        if any(n == 0 for n in lengths):
            raise ValueError("every sequence in a step needs at least one token")
        ids = to_device([t for _, tokens in batch for t in tokens], torch.device("cuda"))
        rows = None if all_logits else host_to(_logit_rows(lengths, num_logits), torch.device("cuda"))
        ctx = ForwardContext([s for s, _ in batch], lengths, device="cuda", logit_rows=rows)
        references = INVARIANT_REFERENCES if batch_invariant else None
        with use_launcher(self._launcher), self._pools([s for s, _ in batch]):
            logits = executor.run({"input_ids": ids}, ctx, batch_invariant, references)["logits"]
        ctx.commit()
        return logits

    @torch.inference_mode()
    def draft(self, batch: list[tuple[SequenceState, list[int]]],
              batch_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the DSpark draft layers over one block per sequence at its next positions, leaving the sequences as
        they were: fp32 (hidden [total tokens, hidden_size], logits [total tokens, vocab]). The blocks' attention
        (every query over its block's whole view) runs on the attention kernel; drafts only need to be good, not
        invariant: verification keeps the output exact."""
        if self.draft_graph is None:
            raise RuntimeError("this model was compiled without DSpark drafting: compile(..., drafting=True)")
        _, executor = self._ready()
        lengths = [len(tokens) for _, tokens in batch]
        if any(n == 0 for n in lengths):
            raise ValueError("every block needs at least one token")
        ids = to_device([t for _, tokens in batch for t in tokens], torch.device("cuda"))
        ctx = ForwardContext([s for s, _ in batch], lengths, device="cuda")
        references = DRAFT_REFERENCES | (INVARIANT_REFERENCES if batch_invariant else {})
        with use_launcher(self._launcher), self._pools([s for s, _ in batch]):
            out = executor.run({"input_ids": ids}, ctx, batch_invariant, references)
        return out["hidden"], out["logits"]

    rollback = CompiledModel.rollback

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] (fp32) of B fresh sequences of T tokens each."""
        batch, tokens = input_ids.shape
        logits = self.step([(self.new_sequence(), row.tolist()) for row in input_ids], all_logits=True)
        return logits.reshape(batch, tokens, -1)


def _logit_rows(lengths: list[int], num_logits: list[int] | None) -> torch.Tensor:
    """The flat token rows whose logits a step returns: the last `num_logits[i]` (default 1) of each chunk."""
    counts = num_logits or [1] * len(lengths)
    if len(counts) != len(lengths) or any(not 1 <= k <= n for k, n in zip(counts, lengths, strict=True)):
        raise ValueError(f"num_logits {counts} must lie in [1, chunk length] for chunks of {lengths}")
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return torch.cat([torch.arange(e - k, e) for e, k in zip(ends, counts, strict=True)])


def load(path, model=None) -> GpuCompiledModel:
    """Read an artifact saved by `compile(...).save(path)`. The weights come from `model` (a DeepseekV41Flash),
    else from the checkpoint directory the artifact names."""
    from deepinfer.models.deepseek_v41 import DeepseekV41Flash
    from dsl.passes import run_passes

    manifest, plan, specs, cubins, draft_plan = artifact.read(path)
    if model is None:
        if not manifest.get("model_dir"):
            raise ValueError(f"{path} names no checkpoint: pass the model")
        model = DeepseekV41Flash.from_pretrained(manifest["model_dir"])
    if artifact.config_hash(model.config.to_dict()) != manifest["model_config_hash"]:
        raise ValueError(f"{path} was compiled for another model config")
    graph = run_passes(model.graph(dspark=draft_plan is not None))
    plan.check_graph(graph)
    draft = None
    if draft_plan is not None:
        draft = (run_passes(model.draft_graph()), draft_plan)
        draft_plan.check_graph(draft[0])
    return GpuCompiledModel(model.config, graph, plan, specs, cubins, model.params(), model.model_dir, draft=draft)


__all__ = ["GpuCompiledModel", "load"]
