"""Which part of the model one pipeline chunk builds (the model side of pipeline parallelism)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class PipelineChunk:
    """The part of a GPTModel one pipeline chunk holds.

    ``pre_process``: the chunk holds the embedding and takes token ids (first chunk of the
    first stage). ``post_process``: it holds ``decoder.final_layernorm`` and ``output_layer``
    and returns logits (last chunk of the last stage). ``layers``: the GLOBAL indices of its
    transformer layers, ``range(start, stop)`` (``megadlms.pipeline.stage_layers`` gives them);
    None means all layers. The default (both True, all layers) is the whole model.
    """

    pre_process: bool = True
    post_process: bool = True
    layers: Optional[range] = None

    def layer_range(self, num_layers: int) -> range:
        """The chunk's global layer range, checked against ``num_layers``."""
        layers = range(num_layers) if self.layers is None else self.layers
        if not isinstance(layers, range) or layers.step != 1:
            raise ValueError(f"PipelineChunk.layers must be a range(start, stop), got {layers!r}")
        if layers.start < 0 or layers.stop > num_layers or len(layers) == 0:
            raise ValueError(
                f"PipelineChunk.layers {layers} must be a non-empty part of the model's "
                f"num_layers {num_layers} layers"
            )
        if self.pre_process and layers.start != 0:
            raise ValueError(f"a pre_process chunk must start at layer 0, got layers {layers}")
        if self.post_process and layers.stop != num_layers:
            raise ValueError(
                f"a post_process chunk must end at the last layer ({num_layers}), got layers {layers}"
            )
        return layers

    def is_whole_model(self, num_layers: int) -> bool:
        return self.pre_process and self.post_process and self.layer_range(num_layers) == range(num_layers)


WHOLE_MODEL = PipelineChunk()
