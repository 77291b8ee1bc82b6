"""What the loop reports after each step, as Megatron's ``training_log`` does: TensorBoard /
W&B scalars every --tensorboard-log-interval steps (the step's own values), the progress line
every --log-interval (the interval's means and counts), and --log-progress's progress.txt.

Collectives (--log-num-zeros-in-grad, --log-params-norm, the phase timers' max over ranks) run
on every rank at the same iterations: each condition depends on the config and the iteration
only, never on which rank holds a writer.

The reporter reads the loop's state as data (``run_state.TrainerCounters`` and
``ThroughputWindow``, passed in with each call), never the trainer itself.
"""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import datetime
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from megadlms.common.enums import AttnMaskType, Objective
from megadlms.config import RunConfig
from megadlms.diffusion import model_length
from megadlms.models import num_floating_point_operations
from megadlms.models.moe import moe_layer_stats

from .logging_utils import MetricsLogger, memory_gb, memory_scalars
from .run_state import ThroughputWindow, TrainerCounters
from .step import StepOut
from .validation import params_norm

# Megatron's tags that TensorBoard also writes "vs samples" (training.py training_log).
VS_SAMPLES = (
    "learning-rate",
    "batch-size",
    "lm loss",
    "real input length",
    "loss-scale",
    "world-size",
    "grad-norm",
    "num-zeros",
    "params-norm",
)
PHASES = ("forward-backward", "optimizer")  # Megatron's timer names of the phases we time


def num_zeros_in_grad(optimizer) -> int:
    """Zero elements of the main gradients (collective): the tensors and the sum of the grad
    norm (``layout.norm_and_clip_tensors`` / ``all_reduce_sum``), so each element counts once
    over the tp / pp / dp shards, as ``sharding.counts_once`` counts it."""
    layout = optimizer.layout
    tensors, _ = layout.norm_and_clip_tensors(layout.collect_grads())
    device = getattr(layout, "device", None) or (tensors[0].device if tensors else None)
    count = torch.zeros(1, dtype=torch.float64, device=device)
    for g in tensors:
        count += (g == 0).sum().to(count)
    reduce = layout.all_reduce_sum()
    if reduce is not None:
        reduce(count)
    return int(count.item())


class JobStart(NamedTuple):
    """The earliest job of the current world size in progress.txt (:meth:`ProgressLog.start`)."""

    time: datetime
    flops: float
    """The floating-point operations done when it started."""


class ProgressLog:
    """Megatron's <--save>/progress.txt (``append_to_progress_log``): tab-separated lines of
    time, job id, GPU count and an event, written by rank 0."""

    def __init__(self, save_dir: str, world_size: int, rank: int) -> None:
        self.path, self.world, self.rank = os.path.join(save_dir, "progress.txt"), world_size, rank

    def append(self, text: str) -> None:
        if self.rank != 0:
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "a") as f:
            stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
            f.write(f"{stamp}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t# GPUs: {self.world}\t{text}\n")

    def start(self) -> JobStart:
        """The earliest job of this world size since the last change of world size (Megatron's
        ``get_start_time_from_progress_log``)."""
        start, start_flops, latest_flops = None, None, 0.0
        with open(self.path) as f:
            for line in f:
                tok = line.strip().split("\t")
                if tok[3] == "Saved checkpoint":
                    latest_flops = float(tok[7].split(": ")[1])
                if int(tok[2].split(": ")[1]) != self.world:
                    start = start_flops = None  # a different world size restarts the search
                elif tok[3] == "Starting job" and start is None:
                    start, start_flops = tok[0], latest_flops
        if start is None or start_flops is None:
            raise ValueError(f"{self.path}: no 'Starting job' line for world size {self.world}")
        return JobStart(datetime.strptime(start, "%Y-%m-%d %H:%M:%S"), start_flops)

    def flops_at(self, iteration: int) -> Optional[float]:
        """The flops recorded with the checkpoint of ``iteration``, if this file has it."""
        if not os.path.exists(self.path):
            return None
        found = None
        with open(self.path) as f:
            for line in f:
                tok = line.strip().split("\t")
                if len(tok) > 7 and tok[4] == f"Iteration: {iteration}":
                    found = float(tok[7].split(": ")[1])
        return found


class Reporter:
    """The trainer's reporting after each step (see the module docstring). ``counters``: the
    loop's counters at its start (after a restore); the other arguments are what the
    collectives and the sinks need (``grad_groups``: the gradients' process groups)."""

    def __init__(
        self,
        config: RunConfig,
        counters: TrainerCounters,
        *,
        metrics: MetricsLogger,
        optimizer,
        model,
        device: torch.device,
        grad_groups,
        world: int,
        rank: int,
    ) -> None:
        # No reference to the trainer: a trainer <-> reporter cycle would keep the trainer (and
        # its data loader) alive after pretrain() until a gc pass, whose shutdown of the loader's
        # workers then waits out their 5 s join timeouts.
        self.config, self.log, self.metrics = config, config.logging, metrics
        self.optimizer, self.model, self.device, self.grad_groups = optimizer, model, device, grad_groups
        self.world, self.rank = world, rank
        self.gbs = config.training.global_batch_size
        self._last = dataclasses.replace(counters)  # the interval's counts start here
        self._input_len = [0.0, 0]  # the interval's sum and count of real_input_length
        self._train_start = time.time()
        self.progress = None
        self.flops_so_far = self._job_start_flops = 0.0
        if self.log.log_progress and config.checkpoint.save:
            self.progress = ProgressLog(config.checkpoint.save, world, rank)
            # Megatron keeps the flops in the checkpoint; ours come from the progress file's line
            # for the resumed iteration, else from full-length steps.
            it = counters.iteration
            length = model_length(config.diffusion, config.model.seq_length)  # block diffusion: 2S
            full = num_floating_point_operations(config.model, self.gbs, length, causal=self._causal)
            at = self.progress.flops_at(it) if it else 0.0
            self.flops_so_far = self._job_start_flops = at if at is not None else it * full
            self.progress.append("Starting job")

    @property
    def _causal(self) -> bool:
        return self.config.model.attention == AttnMaskType.CAUSAL

    def real_input_length(self, out: StepOut) -> Optional[float]:
        """MegaDLMs' ``real input length`` (difflm-noshift only): the model input's length after
        the crop, the mean over the step's micro-batches. The 'megadlms' objective drops one
        position after the crop (``diffusion.loss.objective_inputs``), LLaDA's does not."""
        d = self.config.diffusion
        if not d.diffusion or not out.crop_lengths:
            return None
        shift = 1 if d.objective == Objective.MEGADLMS else 0
        return sum(out.crop_lengths) / len(out.crop_lengths) - shift

    def after_step(
        self, out: StepOut, lr: float, flops: float, counters: TrainerCounters, window: ThroughputWindow
    ) -> bool:
        """Scalars and (every --log-interval) the progress line of the step just done (``flops``:
        its floating-point operations; ``window``: the interval's sums, this step's included);
        True when the progress line was written (the caller starts a new window)."""
        log, it = self.log, counters.iteration
        self.flops_so_far += flops
        log_now = it % log.log_interval == 0 or it == self.config.training.train_iters
        length = self.real_input_length(out)
        if length is not None and not out.nonfinite:  # averaged like the loss: over finite steps
            self._input_len = [self._input_len[0] + length, self._input_len[1] + 1]
        tb_now = self.metrics.writes_scalars and it % log.tensorboard_log_interval == 0
        zeros = pnorm = None
        if tb_now or log_now:
            # Megatron counts zeros only on a step that updated (optimizer.step's return)
            if log.log_num_zeros_in_grad and out.success:
                zeros = num_zeros_in_grad(self.optimizer)
            if log.log_params_norm:
                pnorm = params_norm(self.model, self.device, self.grad_groups)
        if tb_now:
            self._step_scalars(out, lr, counters, zeros, pnorm)
        if log_now:
            self._log_window(window, out, lr, counters, zeros, pnorm)
        return log_now

    def _step_scalars(self, out: StepOut, lr: float, counters: TrainerCounters, zeros, pnorm) -> None:
        log = self.log
        v = {"learning-rate": lr, "batch-size": self.gbs, "lm loss": out.loss}
        length = self.real_input_length(out)
        if length is not None:  # MegaDLMs' second loss-dict key in DLM mode
            v["real input length"] = length
        skipped = (
            counters.skipped_total + counters.nan_total - self._last.skipped_total - self._last.nan_total
        )
        if skipped > 0:  # MegaDLMs' tag: the interval's skipped steps so far
            v["skipped-iterations"] = skipped
        if log.log_loss_scale_to_tensorboard:
            v["loss-scale"] = float(self.optimizer.get_loss_scale())
        if log.log_world_size_to_tensorboard:
            v["world-size"] = self.world
        for tag, x in (("grad-norm", out.grad_norm), ("num-zeros", zeros), ("params-norm", pnorm)):
            if x is not None:
                v[tag] = x
        if log.log_memory_to_tensorboard:
            v.update(memory_scalars())
        if log.log_timers_to_tensorboard and log.timing_log_level >= 1:
            # Megatron's timers.write: the max over ranks, in ms (every rank joins the all-reduce)
            t = torch.tensor(
                [1e3 * out.times.get(p, 0.0) for p in PHASES], dtype=torch.float64, device=self.device
            )
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            v.update({f"{p}-time": x for p, x in zip(PHASES, t.tolist())})
        consumed = counters.consumed
        self.metrics.scalars(
            v, counters.iteration, consumed, VS_SAMPLES, wandb_only={"samples vs steps": consumed}
        )

    def _log_window(
        self, w: ThroughputWindow, out: StepOut, lr: float, counters: TrainerCounters, zeros, pnorm
    ) -> None:
        it, log = counters.iteration, self.log
        sec_per_iter = w.time / w.iters
        tflops = w.flops / w.time / self.world / 1e12  # Megatron's throughput per GPU
        skipped = counters.skipped_total - self._last.skipped_total
        nan = counters.nan_total - self._last.nan_total
        self._last = dataclasses.replace(counters)
        total, n = self._input_len
        self._input_len = [0.0, 0]
        self.metrics.log_train(
            {
                "iteration": it,
                "consumed_samples": counters.consumed,
                "lm_loss": w.loss / w.n_loss if w.n_loss else None,
                "real_input_length": total / n if n else None,
                "lr": lr,
                "global_batch_size": self.gbs,
                "grad_norm": out.grad_norm,
                "loss_scale": float(self.optimizer.get_loss_scale()),
                "num_zeros": zeros,
                "params_norm": pnorm,
                "throughput": tflops if log.log_throughput else None,
                "skipped": int(not out.success),
                # Megatron: a NaN step is a skipped step too, and counted again as nan
                "skipped_iters": skipped + nan,
                "nan_iters": nan,
                "tokens_per_sec": w.tokens / w.time,
                "tflops_per_device": tflops,
                "ms_per_iter": 1e3 * sec_per_iter,
                "mem_gb": memory_gb(),
                "eta_sec": (self.config.training.train_iters - it) * sec_per_iter,
                "skipped_total": counters.skipped_total,
                "nan_total": counters.nan_total,
                **self._moe_metrics(),
            }
        )
        if log.log_timers_to_tensorboard:
            v = {"iteration-time": sec_per_iter, **({"throughput": tflops} if log.log_throughput else {})}
            self.metrics.scalars(v, it, counters.consumed)

    def _moe_metrics(self) -> dict:
        """The MoE layers' aux losses and load balance over the logged window, summed over
        every rank (a collective: every rank logs at the same iterations); {} for dense models."""
        m = self.config.model
        if m.num_moe_experts is None:
            return {}
        s = moe_layer_stats(self.model, reduce=True, reset=True, num_layers=m.num_layers)
        return {
            "moe_aux_loss": s["aux_loss"],
            "moe_z_loss": s["z_loss"],
            "moe_load_max_over_mean": s["max_over_mean"],
            "moe_layers": {str(k): v for k, v in s["layers"].items()},
        }

    def saved(self, counters: TrainerCounters, in_background: bool) -> None:
        """--log-progress: Megatron's line after a (persistent) checkpoint save of
        ``counters.iteration``."""
        if self.progress is None or self.rank != 0:  # rank 0 writes the file, and reads it back
            return
        job = (self.flops_so_far - self._job_start_flops) / (
            (time.time() - self._train_start) * 1e12 * self.world
        )
        start = self.progress.start()
        elapsed = max((datetime.now() - start.time).total_seconds(), 1e-9)
        cumulative = (self.flops_so_far - start.flops) / (elapsed * 1e12 * self.world)
        tokens = counters.consumed * self.config.model.seq_length
        prefix = "Saving async checkpoint" if in_background else "Saved checkpoint"
        self.progress.append(
            f"{prefix}\tIteration: {counters.iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
            f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
            f"Floating-point operations: {self.flops_so_far:.2e}\tTokens (in billions): {tokens / 10**9:.2f}"
        )
