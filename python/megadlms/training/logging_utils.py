"""Rank-0 reporting: the one-line progress format, --metrics-jsonl, TensorBoard, memory.

A progress line reads left to right as "where am I, how is it going, how fast"::

    iter 40/200 ( 20%) | loss 4.8123 | lr 2.00e-04 | gnorm 1.31 | 11.2k tok/s | 0.05 TFLOP/s/dev | 182 ms/it
        | mem 0.9 GB | eta 0:00:29   (one line)

``skipped``/``nan`` counters and the fp16 loss scale are appended only when they matter; MoE
models add ``aux`` (the load-balancing loss summed over the MoE layers, mean per micro-batch)
and ``load`` (the largest tokens-per-expert max/mean of any MoE layer) after the loss.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
from typing import Optional

import torch

_log = logging.getLogger("megadlms")


def setup_logging(rank: int) -> None:
    """INFO on rank 0 (plain messages on stdout), warnings only elsewhere."""
    root = logging.getLogger("megadlms")
    if not any(getattr(h, "_megadlms", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._megadlms = True
        root.addHandler(handler)
        # No propagation: a root handler set by the user (or pytest) would print every line twice.
        root.propagate = False
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def memory_gb() -> float:
    """Peak device memory allocated (CUDA) or the process's peak RSS (CPU), in GB."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def progress_line(m: dict, train_iters: int, *, fp16: bool = False, layout: str = "") -> str:
    """Format one logged interval (keys as in :class:`MetricsLogger.log_train`); ``layout``
    (e.g. ``tp2 x dp2, 1.2M params/rank``) ends the line."""
    it = m["iteration"]
    width = len(str(train_iters))
    parts = [
        f"iter {it:>{width}}/{train_iters} ({100 * it / max(1, train_iters):3.0f}%)",
        "loss " + ("    nan" if m["lm_loss"] is None else f"{m['lm_loss']:.4f}"),
        *(
            [f"aux {m['moe_aux_loss']:.4g}", f"load {m['moe_load_max_over_mean']:.2f}"]
            if "moe_aux_loss" in m
            else []
        ),
        f"lr {m['lr']:.2e}",
        "gnorm " + ("-" if m["grad_norm"] is None else f"{m['grad_norm']:.3g}"),
        *([f"pnorm {m['params_norm']:.4g}"] if m.get("params_norm") is not None else []),
        f"{_si(m['tokens_per_sec'])} tok/s",
        f"{m['tflops_per_device']:.3g} TFLOP/s/dev",
        f"{m['ms_per_iter']:.0f} ms/it",
        f"mem {m['mem_gb']:.2f} GB",
        f"eta {_hms(m['eta_sec'])}",
    ]
    if fp16:
        parts.append(f"scale {m['loss_scale']:.3g}")
    if m["skipped_total"] or m["nan_total"]:
        parts.append(f"skipped {m['skipped_total']} nan {m['nan_total']}")
    if layout:
        parts.append(layout)
    return " | ".join(parts)


class MetricsLogger:
    """Rank-0 sink for train/eval metrics: progress line, JSONL file, TensorBoard."""

    def __init__(
        self,
        *,
        rank: int,
        train_iters: int,
        metrics_jsonl: Optional[str] = None,
        tensorboard_dir: Optional[str] = None,
        fp16: bool = False,
        layout: str = "",
    ) -> None:
        self.active = rank == 0
        self.train_iters, self.fp16, self.layout = train_iters, fp16, layout
        self._jsonl = None
        self._tb = None
        writer_cls = None
        if tensorboard_dir:  # checked on every rank, so a missing package fails everywhere
            try:
                from torch.utils.tensorboard import SummaryWriter as writer_cls
            except ImportError as exc:
                raise ValueError(
                    "--tensorboard-dir needs the tensorboard package: "
                    "pip install tensorboard (or pip install 'megadlms[tensorboard]')"
                ) from exc
        if not self.active:
            return
        if metrics_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_jsonl)), exist_ok=True)
            self._jsonl = open(metrics_jsonl, "a", buffering=1)  # line-buffered: tail -f works
        if writer_cls is not None:
            self._tb = writer_cls(log_dir=tensorboard_dir)

    def _write(self, record: dict) -> None:
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")

    def log_train(self, m: dict) -> None:
        """``m``: iteration, consumed_samples, lm_loss, lr, grad_norm, loss_scale, skipped,
        tokens_per_sec, tflops_per_device, ms_per_iter, mem_gb, eta_sec, skipped_total, nan_total;
        for MoE models also moe_aux_loss, moe_z_loss, moe_load_max_over_mean, moe_layers (per layer:
        aux_loss, z_loss, tokens_per_expert, max_over_mean, forwards)."""
        if not self.active:
            return
        _log.info(progress_line(m, self.train_iters, fp16=self.fp16, layout=self.layout))
        self._write({"event": "train", **m})
        if self._tb is not None:
            step = m["iteration"]
            for key in (
                "lm_loss",
                "lr",
                "grad_norm",
                "params_norm",
                "loss_scale",
                "tokens_per_sec",
                "tflops_per_device",
                "mem_gb",
                "moe_aux_loss",
                "moe_z_loss",
                "moe_load_max_over_mean",
            ):
                if m.get(key) is not None:
                    self._tb.add_scalar(f"train/{key}", m[key], step)

    def log_eval(self, iteration: int, consumed_samples: int, result: dict) -> None:
        if not self.active:
            return
        _log.info(
            f"validation at iter {iteration}: NELBO {result['nelbo']:.4f} per token | "
            f"PPL bound {result['ppl_bound']:.3f} | {result['num_tokens']:.0f} tokens"
        )
        self._write(
            {
                "event": "eval",
                "iteration": iteration,
                "consumed_samples": consumed_samples,
                "valid_nelbo": result["nelbo"],
                "valid_ppl_bound": result["ppl_bound"],
                "valid_tokens": result["num_tokens"],
            }
        )
        if self._tb is not None:
            self._tb.add_scalar("valid/nelbo", result["nelbo"], iteration)
            self._tb.add_scalar("valid/ppl_bound", result["ppl_bound"], iteration)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
