"""Regional compilation (``--use-torch-compile``): ``torch.compile`` applied to each
transformer layer, not to the whole model, as torchtitan does.

Every layer has the same code, so with parameters as graph inputs (torch's default of
inlining built-in nn modules) the first layer's graph serves all of them: the compile cost is
one layer's, whatever the depth. The layers are compiled in place (``nn.Module.compile``):
parameter names, state dicts and checkpoints stay those of the eager model, and the
data-parallel wrappers, tensor-parallel layers and recomputation see the same modules. What is
outside a layer (embedding, output layer, loss, the diffusion objective) stays eager.
Compilation happens at a layer's first call; :func:`compile_seconds` reads how long
dynamo and inductor took so far, so the log can report it apart from the step time.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .transformer import TransformerLayer


def compile_layers(models: Iterable[torch.nn.Module]) -> int:
    """Mark every TransformerLayer of ``models`` (a model or pipeline chunks) for compilation
    at its first call; returns how many."""
    n = 0
    for model in models:
        for module in model.modules():
            if isinstance(module, TransformerLayer):
                module.compile()
                n += 1
    return n


def compile_seconds() -> float:
    """Seconds torch.compile spent so far in this process: dynamo's tracing with inductor's
    forward compile, and the backward compile (at the first backward)."""
    from torch._dynamo.utils import compilation_time_metrics as metrics

    return sum(sum(metrics.get(k, ())) for k in ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler"))
