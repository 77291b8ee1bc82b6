"""Reporting sinks: Megatron's progress and validation lines (rank 0), --metrics-jsonl (rank
0), TensorBoard and W&B with Megatron's tag names (the last rank, as Megatron's writers).

The progress line has Megatron's fields in Megatron's order (``training.py training_log``),
then ours (tokens/s, TFLOP/s per device, memory, eta, MoE load, the layout)::

     [2026-12-02 02:30:00] iteration       40/     200 | consumed samples:          640 |
     elapsed time per iteration (ms): 182.0 | learning rate: 2.000000E-04 | global batch size:
     16 | lm loss: 4.812300E+00 | loss scale: 1.0 | grad norm: 1.310 | number of skipped
     iterations:   0 | number of nan iterations:   0 | tokens/s: 11.2k | ...   (one line)

``lm loss`` is the key MegaDLMs' pretrain_difflm.py logs in both modes (the masked-diffusion
loss in difflm-noshift, the next-token loss in vanilla).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from .wandb_writer import WandbWriter

if TYPE_CHECKING:
    from .validation import Evaluation

_log = logging.getLogger("megadlms")


class _StdoutHandler(logging.StreamHandler):
    """The handler :func:`setup_logging` adds (its class tells a second call it is there)."""


def setup_logging(rank: int) -> None:
    """INFO on rank 0 (plain messages on stdout), warnings only elsewhere."""
    root = logging.getLogger("megadlms")
    if not any(isinstance(h, _StdoutHandler) for h in root.handlers):
        handler = _StdoutHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        root.addHandler(handler)
        # No propagation: a root handler set by the user (or pytest) would print every line twice.
        root.propagate = False
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def memory_gb() -> float:
    """Peak device memory allocated (CUDA) or the process's peak RSS (CPU), in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def memory_scalars() -> dict:
    """--log-memory-to-tensorboard: Megatron's mem-* counters (CUDA); on CPU the peak RSS."""
    if torch.cuda.is_available():
        s = torch.cuda.memory_stats()
        return {
            "mem-reserved-bytes": s["reserved_bytes.all.current"],
            "mem-allocated-bytes": s["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": s["allocated_bytes.all.peak"],
            "mem-allocated-count": s["allocation.all.current"],
        }
    return {"mem-max-rss-bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def param_count(n: float) -> str:
    """A parameter count for the log: millions below 1e9 (three significant digits, as small
    test models print, e.g. ``0.804M``), billions from there (``1.73B``, not ``1.73e+03M``)."""
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress_line(m: dict, train_iters: int, *, layout: str = "", now: Optional[datetime] = None) -> str:
    """One logged interval (keys as in :meth:`MetricsLogger.log_train`) in Megatron's format;
    ``layout`` (e.g. ``tp2 x dp2, 1.2M params/rank``) ends the line."""
    now = now or datetime.now()
    s = f" [{now.strftime('%Y-%m-%d %H:%M:%S')}]"
    s += f" iteration {m['iteration']:8d}/{train_iters:8d} |"
    s += f" consumed samples: {m['consumed_samples']:12d} |"
    s += f" elapsed time per iteration (ms): {m['ms_per_iter']:.1f} |"
    if m.get("throughput") is not None:  # --log-throughput
        s += f" throughput per GPU (TFLOP/s/GPU): {m['throughput']:.1f} |"
    s += f" learning rate: {m['lr']:.6E} |"
    s += f" global batch size: {m['global_batch_size']:5d} |"
    if m["lm_loss"] is not None:  # Megatron leaves out a loss no step of the interval produced
        s += f" lm loss: {m['lm_loss']:.6E} |"
    if m.get("real_input_length") is not None:  # MegaDLMs' difflm-noshift loss-dict key
        s += f" real input length: {m['real_input_length']:.6E} |"
    s += f" loss scale: {m['loss_scale']:.1f} |"
    if m["grad_norm"] is not None:
        s += f" grad norm: {m['grad_norm']:.3f} |"
    if m.get("num_zeros") is not None:
        s += f" num zeros: {float(m['num_zeros'])} |"  # Megatron prints the float count
    if m.get("params_norm") is not None:
        s += f" params norm: {m['params_norm']:.3f} |"
    s += f" number of skipped iterations: {m['skipped_iters']:3d} |"
    s += f" number of nan iterations: {m['nan_iters']:3d} |"
    extra = [
        f"tokens/s: {_si(m['tokens_per_sec'])}",
        f"TFLOP/s/dev: {m['tflops_per_device']:.3g}",
        f"mem: {m['mem_gb']:.2f} GB",
        f"eta: {_hms(m['eta_sec'])}",
    ]
    if "moe_aux_loss" in m:
        extra += [
            f"moe aux loss: {m['moe_aux_loss']:.4g}",
            f"moe load max/mean: {m['moe_load_max_over_mean']:.2f}",
        ]
    if layout:
        extra.append(layout)
    return s + "".join(f" {e} |" for e in extra[:-1]) + f" {extra[-1]}"


def validation_line(prefix: str, result: Evaluation, *, diffusion: bool) -> str:
    """Megatron's `` validation loss at <prefix> | lm loss value: ... | lm loss PPL: ... | ``
    (PPL clamped at exp(20) as Megatron's); a DLM's unclamped bound and the token count follow."""
    loss = result.nelbo
    s = f" validation loss at {prefix} | lm loss value: {loss:.6E} | lm loss PPL: {megatron_ppl(loss):.6E} | "
    if diffusion:  # for a DLM the loss is the NELBO per token: exp of it bounds the perplexity
        s += f"NELBO PPL bound: {result.ppl_bound:.6E} | "
    return s + f"tokens: {result.num_tokens:.0f} |"


def megatron_ppl(loss: float) -> float:
    return math.exp(min(20.0, loss))  # Megatron's clamp (training.py evaluate_and_print_results)


class MetricsLogger:
    """The run's sinks: progress/validation lines and --metrics-jsonl on rank 0, TensorBoard
    and W&B on the last rank (Megatron's ``is_last_rank`` writers). ``log`` is the logging
    config (``config.LoggingConfig``); ``run_record``: the run's configuration for W&B;
    ``device``: where the writers' one-vote all-reduce runs (the collectives' device)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        train_iters: int,
        log,
        save_dir: Optional[str] = None,
        run_record: Optional[dict] = None,
        diffusion: bool = True,
        layout: str = "",
        device=None,
    ) -> None:
        self.active = rank == 0
        self.train_iters, self.layout, self.diffusion, self.log = train_iters, layout, diffusion, log
        self.validation_ppl = log.log_validation_ppl_to_tensorboard
        self._jsonl = self._tb = self._wandb = None
        writer_cls: Any = None
        if log.tensorboard_dir:  # checked on every rank, so a missing package fails everywhere
            try:
                from torch.utils.tensorboard import SummaryWriter as writer_cls
            except ImportError as exc:
                raise ValueError(
                    "--tensorboard-dir needs the tensorboard package: "
                    "pip install tensorboard (or pip install 'megadlms[tensorboard]')"
                ) from exc
        if self.active and log.metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(log.metrics_jsonl)), exist_ok=True)
            self._jsonl = open(log.metrics_jsonl, "a", buffering=1)  # line-buffered: tail -f works
        error = None
        if rank == world_size - 1:
            try:
                if writer_cls is not None:
                    self._tb = writer_cls(log_dir=log.tensorboard_dir, max_queue=log.tensorboard_queue_size)
                if log.wandb.wandb_project:
                    self._wandb = WandbWriter(log.wandb, save_dir=save_dir, run_record=run_record or {})
            except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank knows
                error = exc
        if self.writes_scalars and world_size > 1:
            # One vote: a writer that failed to open (W&B init, an unwritable dir) on the last rank
            # must stop every rank here, not leave the others waiting in the first step's collectives.
            flag = torch.tensor([float(error is not None)], device=device)
            dist.all_reduce(flag)
            if flag.item() > 0 and error is None:
                raise RuntimeError(
                    "the last rank could not open the TensorBoard / W&B writer (see its error)"
                )
        if error is not None:
            raise error

    @property
    def writes_scalars(self) -> bool:
        """A TensorBoard or W&B sink is configured (the same answer on every rank)."""
        return bool(self.log.tensorboard_dir or self.log.wandb.wandb_project)

    def _write(self, record: dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")

    def scalars(self, values: dict, iteration: int, consumed_samples: int, vs_samples=(), wandb_only=None):
        """``values`` (tag -> number) at ``iteration``; the tags in ``vs_samples`` also as
        Megatron's ``<tag> vs samples`` at the consumed samples (TensorBoard only, as Megatron);
        ``wandb_only``: W&B's extra keys (Megatron's ``samples vs steps``)."""
        if self._tb is not None:
            for tag, v in values.items():
                self._tb.add_scalar(tag, v, iteration)
                if tag in vs_samples:
                    self._tb.add_scalar(f"{tag} vs samples", v, consumed_samples)
        if self._wandb is not None:
            self._wandb.log({**(wandb_only or {}), **values}, iteration)

    def log_train(self, m: dict) -> None:
        """The progress line and JSONL record of one interval. ``m``: iteration,
        consumed_samples, lm_loss, lr, global_batch_size, grad_norm, loss_scale, num_zeros,
        params_norm, throughput, skipped_iters / nan_iters (this interval), skipped_total,
        nan_total, tokens_per_sec, tflops_per_device, ms_per_iter, mem_gb, eta_sec; MoE models
        also moe_aux_loss, moe_z_loss, moe_load_max_over_mean, moe_layers. Our extra scalars
        (train/...) go to TensorBoard / W&B at the same iteration."""
        if self.active:
            _log.info(progress_line(m, self.train_iters, layout=self.layout))
            self._write({"event": "train", **m})
        extras = ("tokens_per_sec", "tflops_per_device", "mem_gb", "moe_aux_loss", "moe_z_loss")
        self.scalars(
            {f"train/{k}": m[k] for k in (*extras, "moe_load_max_over_mean") if m.get(k) is not None},
            m["iteration"],
            m["consumed_samples"],
        )

    def log_eval(
        self, iteration: int, consumed_samples: int, result: Evaluation, *, prefix=None, split="validation"
    ):
        """Megatron's validation line (between dashed lines) and its scalars: ``lm loss
        validation`` (and ``... ppl`` with --log-validation-ppl-to-tensorboard; the test set's as
        ``lm loss test``)."""
        line = validation_line(prefix or f"iteration {iteration}", result, diffusion=self.diffusion)
        if self.active:
            for text in ("-" * (len(line) + 1), line, "-" * (len(line) + 1)):
                _log.info(text)
            self._write(
                {
                    # the end-of-training evaluations have their own events: "eval" is per --eval-interval
                    "event": "eval" if prefix is None else f"final_{split}",
                    "iteration": iteration,
                    "consumed_samples": consumed_samples,
                    "valid_nelbo": result.nelbo,
                    "valid_ppl_bound": result.ppl_bound,
                    "valid_tokens": result.num_tokens,
                }
            )
        tag = f"lm loss {split}"
        values = {tag: result.nelbo}
        if self.validation_ppl:
            values[f"{tag} ppl"] = megatron_ppl(result.nelbo)
        if self.diffusion:
            values[f"{split}/ppl_bound"] = result.ppl_bound
        self.scalars(values, iteration, consumed_samples, vs_samples=(tag, f"{tag} ppl"))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
