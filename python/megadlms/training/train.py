"""The masked-diffusion pretraining loop.

One optimizer step (``train_step``):

1. Draw the step's variable-length crop once, count this rank's loss tokens of its
   ``num_micro`` micro-batches; ONE all-reduce gives the step's global count N. Each
   micro-batch's summed loss is divided by N before backward and the wrapper reduces in
   sum mode (``calculate_per_token_loss``: no 1/dp anywhere), so the gradient is
   d(sum of all losses)/N: the same for 1, 2 or 3 ranks and any gradient accumulation (up
   to fp reduction order). This is the one place gradients are normalised.
2. All but the last micro-batch run under ``model.no_sync()``; ``finish_grad_sync()``.
3. ONE all-reduce of [loss sum, non-finite flag, exit flags]: if any rank saw a NaN/Inf
   loss every rank skips the optimizer step (MegaDLMs' nan skipping, --nan-skip-limit).
4. ``optimizer.step() -> (success, grad_norm)`` (clipping, fp16 loss-scale skips
   inside); on success the LR schedule advances by one global batch of samples.

The data-parallel wrapper is whatever ``builders.wrap_model`` chose; this file only uses
the ``DataParallel`` protocol (docs/architecture.md). A failure on one rank inside the
forward/backward is carried by the step's reductions, so every rank stops (DDP).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import logging
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from megadlms.data.packing import add_packing_fields
from megadlms.diffusion import (
    check_model_for_mode,
    compute_loss,
    loss_token_count,
    micro_batch_crop,
)
from megadlms.models import num_floating_point_operations
from megadlms.optimizer import get_optimizer

from . import builders, checkpoint_async, checkpointing, resume
from .collectives import is_comm_error, named_collective
from .config import RunConfig
from .logging_utils import MetricsLogger, memory_gb
from .run_state import RunResult, SignalFlag
from .validation import evaluate, params_norm
from .validation import to_device as _to_device

_log = logging.getLogger("megadlms.training")


@dataclasses.dataclass
class _StepOut:
    loss: float
    grad_norm: Optional[float]
    success: bool
    nonfinite: bool
    exit_flags: List[float]
    seq_length: int


def _forward_backward(model, optimizer, micro_batches, diff_cfg, iteration, crops, scale, device):
    """Loss sum of this rank's micro-batches; backward of each, synced on the last."""
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_sum, _, _ = compute_loss(model, batch, diff_cfg, iteration, crops[i], check=False)
            optimizer.scale_loss(loss_sum * scale).backward()
        local_loss += loss_sum.detach().to(torch.float64)
    return local_loss


def _reduce_step(local_loss, error, exit_flags: List[float], iteration: int, device):
    """ONE all-reduce of [loss sum, NaN/Inf flag, failure flag, exit flags]; a failure on
    any rank raises on every rank (the failing one re-raises its own error)."""
    nonfinite = (~torch.isfinite(local_loss)).to(torch.float64)
    flags = torch.tensor(exit_flags, dtype=torch.float64, device=device)
    failed = torch.tensor([float(error is not None)], dtype=torch.float64, device=device)
    loss = torch.where(nonfinite > 0, 0.0, local_loss).reshape(1)
    packed = torch.cat([loss, nonfinite.reshape(1), failed, flags])
    with named_collective("all-reduce of [loss, NaN flag, failure flag, exit flags]", iteration):
        dist.all_reduce(packed)
    loss_total, nan_ranks, failed_ranks, *exit_reduced = packed.tolist()
    if failed_ranks > 0:
        if error is not None:
            raise error
        raise RuntimeError(
            f"iteration {iteration + 1}: {int(failed_ranks)} other rank(s) failed inside the step "
            "(see their error); stopping this rank too"
        )
    return loss_total, nan_ranks, exit_reduced


def train_step(
    model,
    optimizer,
    micro_batches: List[dict],
    diff_cfg,
    iteration: int,
    *,
    device: torch.device,
    exit_flags: Callable[[], List[float]] = list,
    bidirectional: bool = True,
    data_error: Optional[BaseException] = None,
) -> _StepOut:
    """One optimizer step over this rank's micro-batches (see the module docstring).

    ``exit_flags()`` is read just before the step's reduction, so a request (e.g. SIGTERM)
    that arrived during this step's forward/backward is seen by every rank after it.
    ``data_error``: this rank could not load its micro-batches; it still takes part in the
    step's collectives (contributing nothing) so that every rank stops with the error."""
    crops, local_tokens = [None], torch.zeros((), dtype=torch.float64)
    if data_error is None:
        S, n = micro_batches[0]["labels"].shape[1], len(micro_batches)
        crops = [
            micro_batch_crop(diff_cfg, iteration, i, n, S, bidirectional=bidirectional) for i in range(n)
        ]
        # Device tensors throughout: no host sync until the single reduction after backward.
        local_tokens = torch.stack(
            [loss_token_count(b, c, diff_cfg).to(torch.float64) for b, c in zip(micro_batches, crops)]
        ).sum()
    global_tokens = local_tokens.to(device=device).reshape(1).clone()
    with named_collective("all-reduce of the step's loss-token count", iteration):
        dist.all_reduce(global_tokens)
    # Sum mode divides by N here, once; an averaging wrapper divides by dp itself.
    dp = 1 if model.ddp_config.calculate_per_token_loss else model.comm.world_size
    scale = (dp / global_tokens).to(torch.float32)[0]  # a 0-token step gives inf -> NaN skip

    optimizer.zero_grad()  # zeroes the wrapper's grad buffers too: once per step
    error, local_loss = data_error, torch.zeros((), dtype=torch.float64, device=device)
    try:
        if error is None:
            local_loss = _forward_backward(
                model, optimizer, micro_batches, diff_cfg, iteration, crops, scale, device
            )
    except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank knows
        if is_comm_error(exc):  # a peer is gone: no collective can complete, stop now
            with named_collective(
                "forward/backward (FSDP2 all-gather / gradient bucket reduction)", iteration
            ):
                raise
        error, local_loss = exc, torch.zeros((), dtype=torch.float64, device=device)
    with named_collective("gradient reduction (finish_grad_sync)", iteration):
        model.finish_grad_sync()  # also after a failure: completes this rank's collectives for its peers

    loss_total, nan_ranks, exit_reduced = _reduce_step(local_loss, error, exit_flags(), iteration, device)
    seq_length = S if crops[0] is None else crops[0]  # the throughput line's length
    n_global = float(global_tokens.item())
    if nan_ranks > 0 or n_global <= 0:
        return _StepOut(float("nan"), None, False, True, exit_reduced, seq_length)
    with named_collective(
        "optimizer step (grad-norm all-reduce / parameter all-gather)", iteration, always=False
    ):
        success, grad_norm = optimizer.step()
    return _StepOut(
        loss_total / n_global,
        float(grad_norm) if grad_norm is not None else None,
        bool(success),
        False,
        exit_reduced,
        seq_length,
    )


class Trainer:
    """Owns one run: builds everything from a :class:`RunConfig`, restores a checkpoint,
    then :meth:`train` loops over optimizer steps. Needs an initialised default process
    group (see ``megadlms.pretrain.run``)."""

    def __init__(self, config: RunConfig) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = builders.device_for_rank()
        tokenizer = config.data.tokenizer.build()
        self.config = config = config.with_tokenizer(tokenizer)
        t = config.training
        self.gbs, self.mbs, self.num_micro = t.global_batch_size, t.micro_batch_size, t.num_micro_batches
        self.dp_size = config.parallel.data_parallel_size
        for note in config.logging.notes:
            _log.info(f"note: {note}")

        model = builders.build_model(
            config.model, seed=t.seed, device=self.device, core_attn_implementation=t.core_attn_implementation
        )
        if config.checkpoint.hf_init:  # before wrapping; a --load checkpoint still wins
            builders.init_from_hf(model, config.checkpoint.hf_init)
        check_model_for_mode(model, config.diffusion)  # once, not per micro-batch
        self.num_params = sum(p.numel() for p in model.parameters())
        self.model = builders.wrap_model(model, config)
        self.optimizer = get_optimizer(config.optimizer, self.model)
        self.scheduler = builders.build_scheduler(config.schedule, config.optimizer, self.optimizer, self.gbs)
        self.iteration = self.consumed = self.nan_total = self.skipped_total = 0
        self._pending = None
        self._ckpt_group = checkpoint_async.checkpoint_group(config.checkpoint.async_save)
        self.ckpt = self._restore()

        self._build_data(tokenizer)
        log = config.logging
        self.metrics = MetricsLogger(
            rank=self.rank,
            train_iters=t.train_iters,
            metrics_jsonl=log.metrics_jsonl,
            tensorboard_dir=log.tensorboard_dir,
            fp16=config.optimizer.fp16,
        )
        self.result = RunResult(
            self.iteration, self.consumed, type(self.model).__name__, {}, {}, {}, [], self.skipped_total, {},
            "done", None,
        )  # fmt: skip
        self._log_start()

    def _build_data(self, tokenizer) -> None:
        """Datasets, loaders (positioned at the consumed samples) and the packing fields."""
        config, t = self.config, self.config.training
        log = config.logging
        valid_samples = log.eval_iters * self.gbs if log.eval_interval else 0
        train_ds, valid_ds, test_ds = builders.build_datasets(
            config.data,
            tokenizer,
            seq_length=config.model.seq_length,
            seed=t.seed,
            train_samples=t.train_iters * self.gbs,
            valid_samples=valid_samples,
            test_samples=log.eval_iters * self.gbs,  # Megatron: test_iters = eval_iters
            with_test=True,
        )
        self._packing = None
        if config.data.reset_position_ids or config.data.reset_attention_mask:
            self._packing = functools.partial(
                add_packing_fields,
                eod=tokenizer.eod,
                reset_positions=config.data.reset_position_ids,
                reset_attention=config.data.reset_attention_mask,
            )
        loader = functools.partial(
            builders.build_loader,
            micro_batch_size=self.mbs,
            dp_rank=self.rank,
            dp_size=self.dp_size,
            seed=t.seed,
        )
        self.train_loader = loader(
            train_ds, consumed_samples=self.consumed, num_workers=config.data.num_workers
        )
        self.valid_loader = None if valid_ds is None else loader(valid_ds, consumed_samples=0, num_workers=0)
        self.test_loader = None if test_ds is None else loader(test_ds, consumed_samples=0, num_workers=0)

    def _restore(self) -> Optional[str]:
        """Everything from the checkpoint in one call (weights, optimizer, schedule, RNG, counters)."""
        ck = self.config.checkpoint
        path = resume.resume_path(ck)
        if path is None:
            return None
        path, state = resume.load_verified(path, self.config, self.model, self.optimizer, self.scheduler)
        common = state.common
        if not ck.finetune:
            if not ck.no_load_rng and not state.rng_restored:
                _log.info(
                    f"RNG states not restored: {path} was saved by {common.get('world_size')} ranks, this "
                    f"run has {self.world} (the diffusion noise does not depend on them)"
                )
            self.iteration, self.consumed = state.iteration, state.consumed_samples
            self.nan_total = int(state.extra.get("nan_iterations", 0))
            self.skipped_total = int(state.extra.get("skipped_iterations", 0))
        _log.info(
            f"loaded {path} (iteration {state.iteration}, saved by {common.get('wrapper')} on "
            f"{common.get('world_size')} ranks)" + (" as the --finetune start" if ck.finetune else "")
        )
        return path

    def _log_start(self) -> None:
        c, m = self.config, self.config.model
        _log.info(
            f"megadlms: {type(self.model).__name__} | {self.world} rank(s), "
            f"{dist.get_backend()}, {self.device.type} | GPTModel {self.num_params / 1e6:.2f}M "
            f"params, {m.num_layers} layers, hidden {m.hidden_size}, {m.attention} "
            f"attention, vocab {m.vocab_size} | {c.diffusion.model_running_mode} | global "
            f"batch {self.gbs} = micro {self.mbs} x dp {self.dp_size} x {self.num_micro} accum | "
            f"seq {m.seq_length} | {c.precision}"
        )
        _log.info(
            f"training iterations {self.iteration + 1}..{c.training.train_iters} | lr {c.optimizer.lr:g} "
            f"({self.scheduler.lr_decay_style}, warmup "
            f"{self.scheduler.lr_warmup_steps // self.gbs} it)"
        )

    def save(self) -> None:
        """Checkpoint the current iteration (with --async-save: after the previous background
        save has finished, and in the background; :meth:`wait_for_save` waits for it)."""
        ck = self.config.checkpoint
        self.wait_for_save()
        t0 = time.perf_counter()
        written = checkpointing.save_checkpoint(
            ck.save,
            self.iteration,
            model=self.model,
            scheduler=self.scheduler,
            optimizer=None if ck.no_save_optim else self.optimizer,
            ckpt_format=ck.ckpt_format,
            consumed_samples=self.consumed,
            args=self.config.to_dict(),
            model_config=self.config.model.to_dict(),
            tokenizer=self.config.data.tokenizer.to_dict(),
            extra={"nan_iterations": self.nan_total, "skipped_iterations": self.skipped_total},
            save_rng=not ck.no_save_rng,
            async_group=self._ckpt_group,
        )
        self.result.save_stalls.append(time.perf_counter() - t0)
        if isinstance(written, str):
            self.result.last_checkpoint = written
            _log.info(f"saved checkpoint {written}")
        else:
            self._pending = written
            _log.info(f"saving checkpoint iteration {self.iteration} in the background")

    def wait_for_save(self) -> None:
        """Block until the background save in flight (if any) is complete and in place."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.result.last_checkpoint = pending.wait()
            _log.info(f"saved checkpoint {self.result.last_checkpoint}")

    def _account(self, out: _StepOut, lr: float) -> None:
        """Counters after a step: schedule, NaN/skip counts, the result record."""
        it, limit = self.iteration, self.config.training.nan_skip_limit
        if out.nonfinite:
            self.nan_total += 1
            self.result.nan_iterations.append(it)
            _log.warning(
                f"iteration {it}: NaN/Inf loss on some rank; step skipped everywhere "
                f"({self.nan_total} so far)"
            )
            if self.nan_total > limit:
                raise RuntimeError(
                    f"loss was NaN/Inf on {self.nan_total} iterations, more than --nan-skip-limit {limit}: "
                    "stopping (lower --lr, check the data, or raise --nan-skip-limit)"
                )
        elif out.success:
            self.scheduler.step(self.gbs)
        else:
            self.skipped_total += 1
        self.result.losses[it], self.result.lrs[it] = out.loss, lr
        if out.grad_norm is not None:
            self.result.grad_norms[it] = out.grad_norm

    def _log_window(self, w: dict, out: _StepOut, lr: float) -> None:
        it, c = self.iteration, self.config
        self.metrics.log_train(
            {
                "iteration": it,
                "consumed_samples": self.consumed,
                "lm_loss": w["loss"] / w["n_loss"] if w["n_loss"] else None,
                "lr": lr,
                "grad_norm": out.grad_norm,
                "loss_scale": float(self.optimizer.get_loss_scale()),
                "params_norm": params_norm(self.model, self.device) if c.logging.log_params_norm else None,
                "skipped": int(not out.success),
                "tokens_per_sec": w["tokens"] / w["time"],
                "tflops_per_device": w["flops"] / w["time"] / self.world / 1e12,
                "ms_per_iter": 1e3 * w["time"] / w["iters"],
                "mem_gb": memory_gb(),
                "eta_sec": (c.training.train_iters - it) * w["time"] / w["iters"],
                "skipped_total": self.skipped_total,
                "nan_total": self.nan_total,
            }
        )

    def _stop_reason(self, out: _StepOut) -> Optional[str]:
        if out.exit_flags[0] > 0:
            return "signal"
        if out.exit_flags[1] > 0:
            return "exit_duration"
        interval = self.config.training.exit_interval
        if interval and self.iteration % interval == 0:
            return "exit_interval"
        return None

    def _maybe_evaluate(self) -> None:
        log = self.config.logging
        if not log.eval_interval or self.iteration % log.eval_interval:
            return
        ev = self._evaluate(self.valid_loader)
        if ev is not None:
            self.result.evals[self.iteration] = ev["nelbo"]
            self.metrics.log_eval(self.iteration, self.consumed, ev)

    def _evaluate(self, loader) -> Optional[dict]:
        eval_micro = self.config.logging.eval_iters * self.num_micro
        if loader is None or not eval_micro:
            return None
        ev = evaluate(
            self.model,
            loader,
            self.config.diffusion,
            num_micro_batches=eval_micro,
            num_mc_samples=self.config.diffusion.eval_mc_samples,
            seed=self.config.training.seed,
            device=self.device,
            packing=self._packing,
        )
        self.model.train()
        return ev

    def _final_evaluation(self) -> None:
        """Megatron evaluates the validation and the test set once more after training."""
        for name, loader in (("validation", self.valid_loader), ("test", self.test_loader)):
            ev = self._evaluate(loader)
            if ev is None:
                continue
            self.result.final_evals[name] = ev["nelbo"]
            _log.info(
                f"{name} at the end of training (iteration {self.iteration}): NELBO {ev['nelbo']:.4f} "
                f"per token | PPL bound {ev['ppl_bound']:.3f}"
            )

    def _step(self, data_iter, window: dict, exit_flags) -> _StepOut:
        """One optimizer step with its accounting and throughput window."""
        t0 = time.perf_counter()
        micro, data_error = None, None
        try:
            micro = [_to_device(next(data_iter), self.device) for _ in range(self.num_micro)]
            if self._packing is not None:
                micro = [self._packing(b) for b in micro]
        except Exception as exc:  # noqa: BLE001 - carried by the step's reductions to every rank
            data_error = exc
        lr = self.optimizer.param_groups[0]["lr"]
        out = train_step(
            self.model, self.optimizer, micro, self.config.diffusion, self.iteration,
            device=self.device, exit_flags=exit_flags,
            bidirectional=self.config.model.attention != "causal", data_error=data_error,
        )  # fmt: skip
        self.iteration += 1
        self.consumed += self.gbs
        self._account(out, lr)
        window["time"] += time.perf_counter() - t0
        window["iters"] += 1
        window["tokens"] += self.gbs * out.seq_length
        window["flops"] += num_floating_point_operations(
            self.config.model, self.gbs, out.seq_length, causal=self.config.model.attention == "causal"
        )
        if not out.nonfinite:
            window["loss"] += out.loss
            window["n_loss"] += 1
        train_iters = self.config.training.train_iters
        if self.iteration % self.config.logging.log_interval == 0 or self.iteration == train_iters:
            self._log_window(window, out, lr)
            window.update(_new_window())
        return out

    def train(self) -> RunResult:
        """Optimizer steps until --train-iters or an exit request; saves as asked."""
        t, ck = self.config.training, self.config.checkpoint
        signal_flag = SignalFlag(t.exit_signal_handler)
        start = time.perf_counter()

        def exit_flags():
            minutes = t.exit_duration_in_mins
            over_time = minutes is not None and (time.perf_counter() - start) / 60 > minutes
            return [float(signal_flag.received), float(over_time)]

        window = _new_window()
        last_saved = self.iteration if self.ckpt is not None else None
        data_iter = iter(self.train_loader)
        self.model.train()
        try:
            while self.iteration < t.train_iters:
                # --detect-anomaly: names the forward op whose backward made a NaN (slow)
                with torch.autograd.detect_anomaly() if t.detect_anomaly else contextlib.nullcontext():
                    out = self._step(data_iter, window, exit_flags)
                self._maybe_evaluate()
                stop = self._stop_reason(out)
                scheduled = ck.save and (
                    self.iteration % ck.save_interval == 0 or self.iteration in ck.checkpoint_steps
                )
                if ck.save and (stop is not None or scheduled):
                    self.save()
                    last_saved = self.iteration
                if stop is not None:
                    _log.info(f"exiting at iteration {self.iteration} ({stop})")
                    self.result.exit_reason = stop
                    break
            if ck.save and last_saved != self.iteration:
                self.save()
            if self.result.exit_reason == "done":
                self._final_evaluation()
            self.wait_for_save()  # the exit waits for a background save
        finally:
            signal_flag.restore()
            self.metrics.close()
        self.result.iteration, self.result.consumed_samples = self.iteration, self.consumed
        self.result.skipped_iterations = self.skipped_total
        return self.result


def _new_window() -> dict:
    return {"time": 0.0, "iters": 0, "loss": 0.0, "n_loss": 0, "tokens": 0, "flops": 0.0}


def pretrain(config) -> RunResult:
    """Train one run from a :class:`RunConfig` (or a parsed ``argparse.Namespace``, turned
    into one here); see :class:`Trainer`."""
    if isinstance(config, argparse.Namespace):
        from .arguments import build_run_config

        config = build_run_config(config, dist.get_world_size())
    return Trainer(config).train()
