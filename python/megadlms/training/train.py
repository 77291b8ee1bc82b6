"""The masked-diffusion pretraining loop.

One optimizer step (``train_step``):

1. Take this rank's ``num_micro`` micro-batches of the global batch and count their loss
   tokens (after the step's variable-length crop); ONE all-reduce gives the step's
   global count N. Each micro-batch's summed loss is scaled by dp / N before backward,
   so after the wrapper averages over dp the gradient is d(sum of all losses)/dN: the
   same for 1, 2 or 3 ranks and any gradient accumulation (up to fp reduction order).
2. All but the last micro-batch run under ``model.no_sync()``; ``finish_grad_sync()``.
3. ONE all-reduce of [loss sum, non-finite flag, exit flags]: if any rank saw a NaN/Inf
   loss every rank skips the optimizer step (MegaDLMs' nan skipping, --nan-skip-limit).
4. ``optimizer.step() -> (success, grad_norm)`` (clipping, fp16 loss-scale skips
   inside); on success the LR schedule advances by one global batch of samples.

The data-parallel wrapper is whatever ``builders.wrap_model`` chose; this file only uses
the interface common to our DDP and FSDP2 (DESIGN.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import time
from itertools import islice
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megadlms.diffusion import compute_loss, validation_nelbo, varilen_length
from megadlms.distributed import unwrap_model
from megadlms.models import num_floating_point_operations
from megadlms.optimizer import get_optimizer

from . import builders, checkpointing
from .logging_utils import MetricsLogger, memory_gb

_log = logging.getLogger("megadlms.training")


@dataclasses.dataclass
class RunResult:
    """What a run did (returned by :func:`pretrain`; tests and scripts read it)."""

    iteration: int
    consumed_samples: int
    wrapper: str
    losses: Dict[int, float]
    """Iteration (1-based) -> global per-token loss of that step (nan when skipped for NaN)."""
    grad_norms: Dict[int, float]
    lrs: Dict[int, float]
    nan_iterations: List[int]
    skipped_iterations: int
    evals: Dict[int, float]
    """Iteration -> validation NELBO."""
    exit_reason: str
    """'done', 'exit_interval', 'exit_duration' or 'signal'."""
    last_checkpoint: Optional[str]


class _SignalFlag:
    """Records SIGTERM (--exit-signal-handler); the loop agrees across ranks and saves."""

    def __init__(self, enabled: bool) -> None:
        self.received = False
        self._previous = None
        if enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum, frame) -> None:
        self.received = True

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def _to_device(batch: dict, device: torch.device) -> dict:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def _loss_token_count(batch: dict, crop: Optional[int]) -> torch.Tensor:
    """Loss tokens compute_loss will report for ``batch`` (checked after the forward)."""
    mask = batch.get("loss_mask")
    ref = batch["labels"]
    if crop is not None:
        ref = ref[:, :crop]
        mask = None if mask is None else mask[:, :crop]
    if mask is not None:
        return mask.to(torch.float64).sum()
    return torch.tensor(float(ref.numel()), dtype=torch.float64, device=ref.device)


@dataclasses.dataclass
class _StepOut:
    loss: float
    grad_norm: Optional[float]
    success: bool
    nonfinite: bool
    exit_flags: List[float]
    seq_length: int


def train_step(
    model,
    optimizer,
    micro_batches: List[dict],
    diff_cfg,
    iteration: int,
    *,
    dp_size: int,
    device: torch.device,
    exit_flags: Callable[[], List[float]] = list,
) -> _StepOut:
    """One optimizer step over this rank's micro-batches (see the module docstring).

    ``exit_flags()`` is read just before the step's reduction, so a request (e.g. SIGTERM)
    that arrived during this step's forward/backward is seen by every rank after it."""
    crop = None
    if diff_cfg.model_running_mode != "vanilla":
        crop = varilen_length(
            diff_cfg.seed, iteration, micro_batches[0]["labels"].shape[1], diff_cfg.varilen_prob
        )
    # Device tensors throughout: no host sync until the single reduction after backward.
    local_tokens = torch.stack([_loss_token_count(b, crop) for b in micro_batches]).sum()
    global_tokens = local_tokens.to(device=device, dtype=torch.float64).reshape(1).clone()
    dist.all_reduce(global_tokens)
    scale = (dp_size / global_tokens).to(torch.float32)  # a 0-token step gives inf -> NaN skip

    model.zero_grad_buffer()
    optimizer.zero_grad()
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    reported_tokens = torch.zeros((), dtype=torch.float64, device=device)
    seq_length = micro_batches[0]["labels"].shape[1] if crop is None else crop
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with contextlib.nullcontext() if last else model.no_sync():
            loss_sum, num_tokens, _ = compute_loss(model, batch, diff_cfg, iteration)
            # dp / N: the wrapper averages over dp, so gradients become d(sum loss)/N.
            optimizer.scale_loss(loss_sum * scale[0]).backward()
        local_loss += loss_sum.detach().to(torch.float64)
        reported_tokens += torch.as_tensor(num_tokens, device=device, dtype=torch.float64)
    model.finish_grad_sync()

    # One reduction carries the loss, the NaN/Inf verdict and the exit requests.
    nonfinite = (~torch.isfinite(local_loss)).to(torch.float64)
    flags = torch.tensor(exit_flags(), dtype=torch.float64, device=device)
    packed = torch.cat(
        [
            torch.where(nonfinite > 0, 0.0, local_loss).reshape(1),
            nonfinite.reshape(1),
            flags,
            global_tokens,
            reported_tokens.reshape(1),
            local_tokens.to(device).reshape(1),
        ]
    )
    dist.all_reduce(packed[: 2 + len(flags)])  # the tail (token counts) stays local
    loss_total, nan_ranks, *rest = packed.tolist()
    exit_reduced = rest[: len(flags)]
    n_global, reported, counted = rest[len(flags) :]
    if reported != counted:
        raise RuntimeError(
            f"iteration {iteration + 1}: compute_loss reported {reported:g} loss tokens, "
            f"the trainer counted {counted:g}; the loss normalisation would be wrong"
        )
    if nan_ranks > 0 or n_global <= 0:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        return _StepOut(float("nan"), None, False, True, exit_reduced, seq_length)
    success, grad_norm = optimizer.step()
    return _StepOut(
        loss_total / n_global,
        float(grad_norm) if grad_norm is not None else None,
        bool(success),
        False,
        exit_reduced,
        seq_length,
    )


def evaluate(
    model, loader, diff_cfg, *, num_micro_batches: int, num_mc_samples: int, seed: int, device: torch.device
) -> dict:
    """Validation NELBO over the first ``num_micro_batches`` of ``loader`` on every rank,
    combined over ranks (the same samples every time, so evaluations are comparable)."""
    batches = (_to_device(b, device) for b in islice(iter(loader), num_micro_batches))
    res = validation_nelbo(model, batches, diff_cfg, num_mc_samples=num_mc_samples, seed=seed)
    t = torch.tensor([float(res["loss_sum"]), float(res["num_tokens"])], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    loss_sum, n = t.tolist()
    nelbo = loss_sum / max(n, 1.0)
    return {"nelbo": nelbo, "ppl_bound": math.exp(min(nelbo, 700.0)), "num_tokens": n}


def params_norm(model, device: torch.device) -> float:
    """Global L2 norm of the parameters (collective: sharded DTensor pieces are summed
    over ranks; replicated parameters count once)."""
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p in unwrap_model(model).parameters():
        if hasattr(p, "to_local"):
            sharded += p.to_local().detach().double().square().sum().to(device)
        else:
            replicated += p.detach().double().square().sum().to(device)
    dist.all_reduce(sharded)
    return math.sqrt((sharded + replicated).item())


def _args_dict(args) -> dict:
    return {
        k: (v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v))
        for k, v in vars(args).items()
    }


class Trainer:
    """Owns one run: builds everything from ``args`` (parsed and validated), restores a
    checkpoint, then :meth:`train` loops over optimizer steps. Needs an initialised
    default process group (see ``megadlms.pretrain.run``)."""

    def __init__(self, args) -> None:
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = builders.device_for_rank()
        self.gbs, self.mbs, self.num_micro = builders.batch_schedule(args, self.world)
        for note in args.flags_without_effect:
            _log.info(f"note: {note}")

        tokenizer = builders.tokenizer_from_args(args)
        self.tcfg = builders.transformer_config_from_args(args, tokenizer)
        self.attention = builders.attention_kind(args)
        self.diff_cfg = builders.diffusion_config_from_args(args, tokenizer)
        self.model_cfg = builders.model_config_dict(self.tcfg, self.attention)
        model = builders.build_model(self.tcfg, self.attention, seed=args.seed, device=self.device)
        self.num_params = sum(p.numel() for p in model.parameters())

        self.ckpt, self.common = None, {}
        if args.load:
            self.ckpt = checkpointing.resolve_checkpoint(args.load)
            if self.ckpt is None:
                _log.warning(
                    f"no checkpoint in --load {args.load} (no "
                    f"{checkpointing.LATEST_FILE}); training from scratch"
                )
            else:
                # Weights go into the plain model before wrapping: every wrapper then
                # shards or replicates them itself, whatever produced the checkpoint.
                self.common = checkpointing.load_model_state(self.ckpt, model, model_config=self.model_cfg)
        self.model = builders.wrap_model(model, args, builders.ddp_config_from_args(args))
        self.optimizer = get_optimizer(builders.optimizer_config_from_args(args), self.model)
        self.scheduler = builders.build_scheduler(args, self.optimizer, self.gbs)
        self.iteration = self.consumed = self.nan_total = self.skipped_total = 0
        self._restore()

        train_ds, valid_ds = builders.build_datasets(args, tokenizer, global_batch_size=self.gbs)
        self.train_loader = builders.build_loader(
            train_ds,
            consumed_samples=self.consumed,
            micro_batch_size=self.mbs,
            dp_rank=self.rank,
            dp_size=self.world,
            num_workers=args.num_workers,
        )
        self.valid_loader = (
            None
            if valid_ds is None
            else builders.build_loader(
                valid_ds,
                consumed_samples=0,
                micro_batch_size=self.mbs,
                dp_rank=self.rank,
                dp_size=self.world,
                num_workers=0,
            )
        )
        self.metrics = MetricsLogger(
            rank=self.rank,
            train_iters=args.train_iters,
            metrics_jsonl=args.metrics_jsonl,
            tensorboard_dir=args.tensorboard_dir,
            fp16=bool(args.fp16),
        )
        self.result = RunResult(
            self.iteration,
            self.consumed,
            type(self.model).__name__,
            {},
            {},
            {},
            [],
            self.skipped_total,
            {},
            "done",
            None,
        )
        self._log_start()

    def _restore(self) -> None:
        """Optimizer, schedule, RNG and counters from the checkpoint (unless --finetune)."""
        args, ckpt, common = self.args, self.ckpt, self.common
        if ckpt is None:
            return
        if not args.finetune:
            if not args.no_load_optim:
                checkpointing.load_optimizer_state(ckpt, self.optimizer, self.model)
                # --override-opt-param-scheduler is Megatron's; keep the flags' schedule then
                override = bool(getattr(args, "override_opt_param_scheduler", False))
                self.scheduler.load_state_dict(common["scheduler"], override=override)
            if not args.no_load_rng and not checkpointing.load_rng_state(ckpt):
                _log.info(
                    f"RNG states not restored: {ckpt} was saved by {common.get('world_size')} "
                    f"ranks, this run has {self.world} (the diffusion noise does not depend "
                    "on them)"
                )
            self.iteration, self.consumed = int(common["iteration"]), int(common["consumed_samples"])
            extra = common.get("extra", {})
            self.nan_total = int(extra.get("nan_iterations", 0))
            self.skipped_total = int(extra.get("skipped_iterations", 0))
        _log.info(
            f"loaded {ckpt} (iteration {common['iteration']}, saved by "
            f"{common.get('wrapper')} on {common.get('world_size')} ranks)"
            + (" as the --finetune start" if args.finetune else "")
        )

    def _log_start(self) -> None:
        args, tcfg = self.args, self.tcfg
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
        _log.info(
            f"megadlms: {type(self.model).__name__} | {self.world} rank(s), "
            f"{dist.get_backend()}, {self.device.type} | GPTModel {self.num_params / 1e6:.2f}M "
            f"params, {tcfg.num_layers} layers, hidden {tcfg.hidden_size}, {self.attention} "
            f"attention, vocab {tcfg.vocab_size} | {self.diff_cfg.model_running_mode} | global "
            f"batch {self.gbs} = micro {self.mbs} x dp {self.world} x {self.num_micro} accum | "
            f"seq {args.seq_length} | {precision}"
        )
        _log.info(
            f"training iterations {self.iteration + 1}..{args.train_iters} | lr {args.lr:g} "
            f"({self.scheduler.lr_decay_style}, warmup "
            f"{self.scheduler.lr_warmup_steps // self.gbs} it)"
        )

    def save(self) -> None:
        args = self.args
        self.result.last_checkpoint = checkpointing.save_checkpoint(
            args.save,
            self.iteration,
            model=self.model,
            scheduler=self.scheduler,
            optimizer=None if args.no_save_optim else self.optimizer,
            ckpt_format=args.ckpt_format,
            consumed_samples=self.consumed,
            args=_args_dict(args),
            model_config=self.model_cfg,
            extra={"nan_iterations": self.nan_total, "skipped_iterations": self.skipped_total},
            save_rng=not args.no_save_rng,
        )
        _log.info(f"saved checkpoint {self.result.last_checkpoint}")

    def _account(self, out: _StepOut, lr: float) -> None:
        """Counters after a step: schedule, NaN/skip counts, the result record."""
        it = self.iteration
        if out.nonfinite:
            self.nan_total += 1
            self.result.nan_iterations.append(it)
            _log.warning(
                f"iteration {it}: NaN/Inf loss on some rank; step skipped everywhere "
                f"({self.nan_total} so far)"
            )
            if self.nan_total > self.args.nan_skip_limit:
                raise RuntimeError(
                    f"loss was NaN/Inf on {self.nan_total} iterations, more than "
                    f"--nan-skip-limit {self.args.nan_skip_limit}: stopping (lower "
                    "--lr, check the data, or raise --nan-skip-limit)"
                )
        elif out.success:
            self.scheduler.step(self.gbs)
        else:
            self.skipped_total += 1
        self.result.losses[it], self.result.lrs[it] = out.loss, lr
        if out.grad_norm is not None:
            self.result.grad_norms[it] = out.grad_norm

    def _log_window(self, w: dict, out: _StepOut, lr: float) -> None:
        args, it = self.args, self.iteration
        self.metrics.log_train(
            {
                "iteration": it,
                "consumed_samples": self.consumed,
                "lm_loss": w["loss"] / w["n_loss"] if w["n_loss"] else None,
                "lr": lr,
                "grad_norm": out.grad_norm,
                "loss_scale": float(self.optimizer.get_loss_scale()),
                "params_norm": params_norm(self.model, self.device) if args.log_params_norm else None,
                "skipped": int(not out.success),
                "tokens_per_sec": w["tokens"] / w["time"],
                "tflops_per_device": w["flops"] / w["time"] / self.world / 1e12,
                "ms_per_iter": 1e3 * w["time"] / w["iters"],
                "mem_gb": memory_gb(),
                "eta_sec": (args.train_iters - it) * w["time"] / w["iters"],
                "skipped_total": self.skipped_total,
                "nan_total": self.nan_total,
            }
        )

    def _stop_reason(self, out: _StepOut) -> Optional[str]:
        if out.exit_flags[0] > 0:
            return "signal"
        if out.exit_flags[1] > 0:
            return "exit_duration"
        if self.args.exit_interval and self.iteration % self.args.exit_interval == 0:
            return "exit_interval"
        return None

    def train(self) -> RunResult:
        """Optimizer steps until --train-iters or an exit request; saves as asked."""
        args = self.args
        signal_flag = _SignalFlag(bool(args.exit_signal_handler))
        start = time.perf_counter()

        def exit_flags():
            minutes = args.exit_duration_in_mins
            over_time = minutes is not None and (time.perf_counter() - start) / 60 > minutes
            return [float(signal_flag.received), float(over_time)]

        new_window = lambda: {
            "time": 0.0,
            "iters": 0,
            "loss": 0.0,
            "n_loss": 0,
            "tokens": 0,  # noqa: E731
            "flops": 0.0,
        }
        window = new_window()
        last_saved = self.iteration if self.ckpt is not None else None
        data_iter = iter(self.train_loader)
        eval_micro = args.eval_iters * self.num_micro
        self.model.train()
        try:
            while self.iteration < args.train_iters:
                t0 = time.perf_counter()
                micro = [_to_device(next(data_iter), self.device) for _ in range(self.num_micro)]
                lr = self.optimizer.param_groups[0]["lr"]
                out = train_step(
                    self.model,
                    self.optimizer,
                    micro,
                    self.diff_cfg,
                    self.iteration,
                    dp_size=self.world,
                    device=self.device,
                    exit_flags=exit_flags,
                )
                self.iteration += 1
                self.consumed += self.gbs
                self._account(out, lr)

                window["time"] += time.perf_counter() - t0
                window["iters"] += 1
                window["tokens"] += self.gbs * out.seq_length
                window["flops"] += num_floating_point_operations(
                    self.tcfg, self.gbs, out.seq_length, causal=self.attention == "causal"
                )
                if not out.nonfinite:
                    window["loss"] += out.loss
                    window["n_loss"] += 1
                if self.iteration % args.log_interval == 0 or self.iteration == args.train_iters:
                    self._log_window(window, out, lr)
                    window = new_window()

                if (
                    args.eval_interval
                    and self.valid_loader is not None
                    and eval_micro
                    and self.iteration % args.eval_interval == 0
                ):
                    ev = evaluate(
                        self.model,
                        self.valid_loader,
                        self.diff_cfg,
                        num_micro_batches=eval_micro,
                        num_mc_samples=args.difflm_eval_mc_samples,
                        seed=args.seed,
                        device=self.device,
                    )
                    self.result.evals[self.iteration] = ev["nelbo"]
                    self.metrics.log_eval(self.iteration, self.consumed, ev)
                    self.model.train()

                stop = self._stop_reason(out)
                if args.save and (
                    stop is not None or (args.save_interval and self.iteration % args.save_interval == 0)
                ):
                    self.save()
                    last_saved = self.iteration
                if stop is not None:
                    _log.info(f"exiting at iteration {self.iteration} ({stop})")
                    self.result.exit_reason = stop
                    break
            if args.save and last_saved != self.iteration:
                self.save()
        finally:
            signal_flag.restore()
            self.metrics.close()
        self.result.iteration, self.result.consumed_samples = self.iteration, self.consumed
        self.result.skipped_iterations = self.skipped_total
        return self.result


def pretrain(args) -> RunResult:
    """Build everything from ``args`` (parsed and validated) and train; see :class:`Trainer`."""
    return Trainer(args).train()
