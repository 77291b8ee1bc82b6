"""The step's FLOPs, communication bytes per collective kind, and a predicted step time.

FLOPs are the trainer's own count (``models.num_floating_point_operations`` with the
trainer's arguments: the global batch, the sequence length, causal or not), never re-derived.

The step-time model, stated so its error can be read against measurements:

    step = compute / (peak * gemm_efficiency) + pipeline bubble + exposed communication

* compute: this rank's share of the step's FLOPs (FLOPs / world); full recomputation adds
  one forward (x 4/3); selective recomputation's small attention replay is not charged.
* bubble: ``(pp - 1) / (vp * m)`` of the compute (1F1B / interleaved, m micro-batches).
* communication, per collective kind, each at the bandwidth of the link its group crosses
  (NVLink when the group fits in one node, else InfiniBand) with ring algorithms' volume
  (all-reduce ``2(n-1)/n``, all-gather / reduce-scatter ``(n-1)/n`` of the full buffer):
  tensor parallel (4 all-reduces of the layer's activations per layer and micro-batch, or
  all-gather + reduce-scatter under sequence parallelism), context parallel (K/V all-gather
  forward, reduce-scatter backward), expert parallel (4 all-to-alls of the routed tokens per
  MoE layer), pipeline send/recv (one activation per chunk boundary each way), and data
  parallel (the grad buffers' all-reduce or reduce-scatter + the param all-gather; FSDP2:
  per micro-batch all-gathers of the 16-bit weights and a reduce-scatter of the gradients).
* overlap: data-parallel traffic with ``--overlap-grad-reduce`` / ``--overlap-param-gather``
  (FSDP2 always) hides behind the backward (2/3 of compute) / forward (1/3); only the excess
  is exposed. Every other kind is exposed (it sits on the critical path of a layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from megadlms.common.enums import AttnMaskType, RecomputeGranularity
from megadlms.config import RunConfig
from megadlms.diffusion import model_length
from megadlms.models import num_floating_point_operations

from .devices import Device
from .memory import StateBytes, shard_groups

__all__ = ["StepTime", "step_flops", "step_time"]


def step_flops(config: RunConfig) -> float:
    """The FLOPs the trainer logs for one full-length step (training/train.py's call: block
    diffusion runs [x_t ; x_0], twice the tokens)."""
    causal = config.model.attention == AttnMaskType.CAUSAL
    length = model_length(config.diffusion, config.model.seq_length)
    gbs = config.training.global_batch_size
    return num_floating_point_operations(config.model, gbs, length, causal=causal)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step on one rank, by part, and the resulting MFU."""

    flops: float
    compute_s: float
    bubble_s: float
    comm_bytes: Dict[str, float]  # per collective kind, bytes this rank sends per step
    comm_s: Dict[str, float]  # per kind, seconds at the link's bandwidth
    exposed_s: Dict[str, float]  # per kind, the part not hidden behind compute
    step_s: float
    mfu: float
    tokens_per_s: float


def _bw(dev: Device, span: int) -> float:
    """Bytes/s of a group whose ranks lie within ``span`` consecutive global ranks."""
    return (dev.nvlink_gbps if span <= dev.gpus_per_node else dev.ib_gbps) * 1e9


def _ring(n: int, kind: str) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def _comm_bytes(config: RunConfig, state: StateBytes) -> Dict[str, float]:
    m, par, t = config.model, config.parallel, config.training
    tp, cp, pp = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
    ep = par.expert_model_parallel_size
    item = 2 if (config.optimizer.bf16 or config.optimizer.fp16) else 4
    micro, b = t.num_micro_batches, t.micro_batch_size
    s_local = m.seq_length / cp
    layers = m.num_layers / pp
    act = s_local * b * m.hidden_size * item  # one [s/C, b, h] activation
    out: Dict[str, float] = {}
    # 2 forward + 2 backward all-reduces per layer (SP: the same volume as all-gather + reduce-scatter)
    out["tensor_parallel"] = 4 * layers * micro * act * _ring(tp, "all_reduce")
    kv = 2 * b * m.seq_length * (m.num_query_groups or m.num_attention_heads) * m.kv_channels / tp * item
    out["context_parallel"] = 2 * layers * micro * kv * _ring(cp, "all_gather")
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers)) / pp if m.num_moe_experts else 0
    routed = s_local * b * m.moe_router_topk * m.hidden_size * item / (tp if par.sequence_parallel else 1)
    out["expert_all_to_all"] = 4 * moe_layers * micro * routed * _ring(ep, "all_gather")
    boundary = act / (tp if par.sequence_parallel else 1)
    vp = par.virtual_stages(m.num_layers)
    out["pipeline_p2p"] = 2 * micro * vp * boundary if pp > 1 else 0.0
    out.update(_data_parallel_bytes(config, state))
    return out


def _data_parallel_bytes(config: RunConfig, state: StateBytes) -> Dict[str, float]:
    groups, ddp = shard_groups(config), config.ddp
    if config.parallel.use_torch_fsdp2:
        n = groups.shard
        gathers = 2 if config.parallel.torch_fsdp2_reshard_after_forward else 1
        item = 2 if config.optimizer.bf16 else 4
        full = state.params * item  # the unsharded 16-bit weights of this rank's model part
        micro = config.training.num_micro_batches if gathers == 2 else 1
        return {
            "dp_all_gather": gathers * micro * full * _ring(n, "all_gather"),
            "dp_reduce_scatter": micro * state.params * 4 * _ring(n, "reduce_scatter"),
        }
    if ddp.use_distributed_optimizer:
        n = groups.shard
        return {
            "dp_reduce_scatter": state.grads * _ring(n, "reduce_scatter"),
            "dp_all_gather": state.weights * _ring(n, "all_gather"),
        }
    return {"dp_all_reduce": state.grads * _ring(groups.reduce, "all_reduce")}


def _spans(config: RunConfig) -> Dict[str, int]:
    """How many consecutive global ranks each kind's group spans (rank order tp, cp, dp, pp)."""
    par = config.parallel
    tp, cp, pp = par.tensor_model_parallel_size, par.context_parallel_size, par.pipeline_model_parallel_size
    dp = par.data_parallel_size or 1
    ep = par.expert_model_parallel_size
    dp_span = tp * cp * dp
    return {
        "tensor_parallel": tp,
        "context_parallel": tp * cp,
        "expert_all_to_all": tp * ep,
        "pipeline_p2p": tp * cp * dp * pp,
        "dp_all_reduce": dp_span,
        "dp_reduce_scatter": tp * cp * dp // config.ddp.num_distributed_optimizer_instances,
        "dp_all_gather": tp * cp * dp // config.ddp.num_distributed_optimizer_instances,
    }


def step_time(config: RunConfig, state: StateBytes, dev: Device) -> StepTime:
    """The predicted step (see the module docstring for the model)."""
    par, ddp = config.parallel, config.ddp
    world = par.world_size
    flops = step_flops(config)
    compute = flops / world / (dev.peak_tflops * 1e12 * dev.gemm_efficiency)
    if config.model.recompute_granularity == RecomputeGranularity.FULL:
        compute *= 4 / 3  # one more forward (1/3 of the model FLOPs) per recomputed layer
    pp, m = par.pipeline_model_parallel_size, config.training.num_micro_batches
    bubble = compute * (pp - 1) / (par.virtual_stages(config.model.num_layers) * m)
    nbytes = _comm_bytes(config, state)
    spans = _spans(config)
    seconds = {k: v / _bw(dev, spans[k]) for k, v in nbytes.items()}
    fsdp = par.use_torch_fsdp2
    hidden_behind = {
        "dp_all_reduce": 2 / 3 * compute if ddp.overlap_grad_reduce else 0.0,
        "dp_reduce_scatter": 2 / 3 * compute if (ddp.overlap_grad_reduce or fsdp) else 0.0,
        "dp_all_gather": 1 / 3 * compute if (ddp.overlap_param_gather or fsdp) else 0.0,
    }
    exposed = {k: max(0.0, v - hidden_behind.get(k, 0.0)) for k, v in seconds.items()}
    step = compute + bubble + sum(exposed.values())
    tokens = config.training.global_batch_size * model_length(config.diffusion, config.model.seq_length)
    return StepTime(
        flops=flops,
        compute_s=compute,
        bubble_s=bubble,
        comm_bytes=nbytes,
        comm_s=seconds,
        exposed_s=exposed,
        step_s=step,
        mfu=flops / (step * world * dev.peak_tflops * 1e12),
        tokens_per_s=tokens / step,
    )
