"""One layout's plan: memory per rank, whether it fits, and the predicted step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict

from megadlms.config import RunConfig
from megadlms.data import build_tokenizer

from .activations import activation_bytes
from .devices import Device
from .memory import StateBytes, state_bytes
from .throughput import StepTime, step_time

__all__ = ["Plan", "plan", "with_vocabulary"]


@dataclass(frozen=True)
class _Vocabulary:
    """The two numbers ``RunConfig.with_tokenizer`` reads, when --vocab-size gives them."""

    vocab_size: int
    mask_token_id: int


def with_vocabulary(config: RunConfig) -> RunConfig:
    """The config with the padded vocabulary filled in, as the trainer does: from --vocab-size
    when given (no tokenizer file needed), else from the tokenizer the flags name."""
    tok = config.data.tokenizer
    if tok.vocab_size:
        mask = config.diffusion.mask_token_id
        return config.with_tokenizer(_Vocabulary(tok.vocab_size, mask if mask > 0 else tok.vocab_size - 1))
    return config.with_tokenizer(build_tokenizer(tok.tokenizer_type, tok.tokenizer_model))


@dataclass(frozen=True)
class Plan:
    """The busiest rank's memory (bytes), whether it fits the device, and the predicted step."""

    config: RunConfig
    device: Device
    state: StateBytes  # the pipeline stage with the most model state
    activations: Dict[str, float]  # the first stage (most in-flight micro-batches)
    step: StepTime

    @property
    def total(self) -> float:
        return self.state.total + sum(self.activations.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.device.hbm_gb * 1e9

    def layout(self) -> Dict[str, object]:
        par, t, m = self.config.parallel, self.config.training, self.config.model
        return {
            "world": par.world_size, "tp": par.tensor_model_parallel_size,
            "pp": par.pipeline_model_parallel_size, "vp": par.virtual_stages(m.num_layers),
            "cp": par.context_parallel_size, "ep": par.expert_model_parallel_size,
            "dp": par.data_parallel_size, "sp": par.sequence_parallel,
            "fsdp2": par.use_torch_fsdp2, "dist_opt": self.config.ddp.use_distributed_optimizer,
            "instances": self.config.ddp.num_distributed_optimizer_instances,
            "recompute": str(m.recompute_granularity or "none"),
            "micro_batch": t.micro_batch_size, "global_batch": t.global_batch_size,
        }  # fmt: skip

    def to_dict(self) -> Dict[str, object]:
        return {
            "layout": self.layout(),
            "device": dataclasses.asdict(self.device),
            "bytes_per_rank": {
                "weights": self.state.weights, "grads": self.state.grads, "optimizer": self.state.optimizer,
                **{f"activations_{k.replace(' ', '_')}": v for k, v in self.activations.items()},
                "total": self.total,
            },
            "params_per_rank": self.state.params,
            "fits": self.fits,
            "step": dataclasses.asdict(self.step),
        }  # fmt: skip


def plan(config: RunConfig, device: Device) -> Plan:
    """The plan of ``config`` (its vocabulary already filled in: :func:`with_vocabulary`)."""
    pp = config.parallel.pipeline_model_parallel_size
    states = [state_bytes(config, pp_rank=r) for r in range(pp)]
    state = max(states, key=lambda s: s.total)
    return Plan(config, device, state, activation_bytes(config), step_time(config, state, device))
