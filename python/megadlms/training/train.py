"""The masked-diffusion pretraining loop: :class:`Trainer` builds a run from its
:class:`RunConfig`, restores a checkpoint, then loops over optimizer steps
(``step.train_step``: one step, its reductions and the NaN skip), evaluates and saves.

The data-parallel wrapper is whatever ``builders.wrap_model`` chose; this file only uses
the ``DataParallel`` protocol (docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from megadlms.checkpoint import Checkpointer, ParallelLayout, RunRecords
from megadlms.common.enums import AttnMaskType
from megadlms.config import RunConfig
from megadlms.data.packing import add_packing_fields
from megadlms.diffusion import check_model_for_mode
from megadlms.distributed import DataParallel
from megadlms.models import GPTModel, num_floating_point_operations
from megadlms.models.compile import compile_layers, compile_seconds
from megadlms.optimizer import get_optimizer
from megadlms.parallel.sharding import counts_once

from . import builders, pipeline_run
from .failures import FailureChannel, guarded
from .logging_utils import MetricsLogger, param_count
from .profiling import StepProfiler
from .reporting import Reporter
from .rerun import RerunExit, RerunMachine
from .run_state import RunResult, SignalFlag, ThroughputWindow, TrainerCounters
from .step import StepOut, UnpairedStepFailure, train_step
from .straggler import StragglerReport
from .validation import Evaluation, evaluate
from .validation import to_device as _to_device

_log = logging.getLogger("megadlms.training")


class Trainer:
    """Owns one run: builds everything from a :class:`RunConfig`, restores a checkpoint,
    then :meth:`train` loops over optimizer steps. Needs an initialised default process
    group (see ``megadlms.pretrain.run``). ``init_model(model)`` fills the freshly built plain
    model (or the list of pipeline chunks) before wrapping, e.g. with --hf-init's weights.
    ``failures``: the process's :class:`FailureChannel` (``pretrain.run`` starts one when it owns
    the process group): a failure outside the step then stops every rank at once."""

    def __init__(
        self,
        config: RunConfig,
        init_model: Optional[Callable[[Any], None]] = None,
        failures: Optional[FailureChannel] = None,
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.failures = failures
        self.device = builders.device_for_rank()
        tokenizer = config.data.tokenizer.build()
        t = config.training
        # Groups first: the Checkpointer holds them; the checkpoint found pads the vocabulary.
        self.groups, self.tp = builders.build_parallel(config, self.device, t.seed)
        # Parameters are replicated over dp x cp: wrapper, optimizer, norms and checkpoint see dp_cp as dp.
        self.grad_groups = self.groups.for_gradients()
        pp = self.groups.pp
        vp = config.parallel.virtual_stages(config.model.num_layers) if pp.size > 1 else 1
        self.checkpointer = Checkpointer(
            config.checkpoint,
            ParallelLayout.of_run(self.grad_groups, self.tp, vp),
            override_scheduler=config.schedule.override_opt_param_scheduler,
        )
        # Find the checkpoint before building the model: a tp-dependent padded vocabulary it recorded is kept
        # when this layout can split it, so a resumed run builds the embedding shape it saved.
        self._resume_from = self.checkpointer.find()
        vocab = self.checkpointer.recorded_vocab(self._resume_from)
        # Rebound: everything below must see the tokenizer-derived vocab, not the one the caller passed.
        self.config = config = config.with_tokenizer(tokenizer, vocab)
        self.gbs, self.mbs, self.num_micro = t.global_batch_size, t.micro_batch_size, t.num_micro_batches
        self.dp_size = config.parallel.data_parallel_size
        for note in config.logging.notes:
            _log.info(f"note: {note}")

        # Only tensor-parallel rank 0 of each replica (on the last pipeline stage, which holds
        # the loss) counts its (shared) loss in the reductions.
        self.loss_owner = self.groups.tp.rank == 0 and pp.rank == pp.size - 1
        kw: Dict[str, Any] = dict(
            seed=t.seed, device=self.device, core_attn_implementation=t.core_attn_implementation, tp=self.tp
        )
        # pp 1: one plain model; pp > 1: this rank's chunks
        model: Union[torch.nn.Module, List[GPTModel]] = (
            builders.build_model(config.model, **kw)
            if pp.size == 1
            else pipeline_run.build_chunks(config, pp.rank, **kw)
        )
        # init_model: e.g. --hf-init's weights (megadlms.pretrain hands it in: hf/ sits above
        # training/); before wrapping, so a --load checkpoint still wins
        if init_model is not None:
            init_model(model)
        elif config.checkpoint.hf_init:  # never train from random weights the user did not ask for
            raise ValueError(
                "checkpoint.hf_init needs init_model (megadlms.pretrain.run passes the HF importer)"
            )
        parts: List[torch.nn.Module] = list(model) if isinstance(model, list) else [model]
        check_model_for_mode(parts[0], config.diffusion)  # once, not per micro-batch
        self.params_per_rank = sum(p.numel() for m in parts for p in m.parameters())
        # A collective (all-reduce over the world): every rank reaches this line in the same order.
        self.num_params = _logical_params(parts, self.grad_groups, self.device)
        # --use-torch-compile: each transformer layer, in place (names and checkpoints unchanged), before
        # the wrapper as torchtitan orders it; the compile itself happens at the first forward.
        self._compile_to_report = t.use_torch_compile
        if t.use_torch_compile:
            _log.info(
                f"torch.compile: {compile_layers(parts)} transformer layers, each compiled at its first call"
            )
        # Wrap after init_model: the wrapper buckets (DDP) or shards (FSDP2) the parameters as they are, so
        # they must already hold their final values.
        self.model = builders.wrap_model(model, config, self.grad_groups)
        # the step's schedule
        self.runner = pipeline_run.PipelineRunner(
            self.groups, self.model, sharded=config.parallel.use_torch_fsdp2
        )
        # validation's forward-only pipeline; under cp also the one-stage path, which shards the sequence
        self.pipeline = self.runner if pp.size > 1 or self.groups.cp.size > 1 else None
        # The optimizer after the wrapper: it must hold the wrapped (under FSDP2, sharded) parameters.
        self.optimizer = get_optimizer(config.optimizer, self.model)
        self.scheduler = builders.build_scheduler(config.schedule, config.optimizer, self.optimizer, self.gbs)
        self.counters = TrainerCounters()  # the loop's state: the checkpoint's and the reporter's
        # Result validation (--rerun-mode); its state rides in the checkpoint's extra
        self.rerun = RerunMachine(
            config.resilience, check_nan=t.check_for_nan_in_loss_and_grad, model=self.model, seed=t.seed,
            device=self.device, rng_tracker=self.tp.rng_tracker, log_interval=config.logging.log_interval,
        )  # fmt: skip
        # Restore once model, optimizer and scheduler all exist: one load fills them all.
        self.ckpt = self._restore()

        # Data after the restore: the train loader starts at the restored consumed_samples.
        with self._phase("data-loader construction"):
            self._build_data(tokenizer)
        with self._phase("logging"):  # rank 0 opens its files: a bad path must not leave the others waiting
            self.metrics = self._metrics_logger()
        self.reporter = Reporter(  # after the restore: it starts from the restored counters
            config, self.counters, metrics=self.metrics, optimizer=self.optimizer, model=self.model,
            device=self.device, grad_groups=self.grad_groups, world=self.world, rank=self.rank,
        )  # fmt: skip
        self.result = RunResult.starting_at(self.counters, type(self.model).__name__)
        res = config.resilience  # --log-straggler: per-rank step times every log interval
        self.straggler = StragglerReport(
            enabled=res.log_straggler, interval=config.logging.log_interval,
            minmax_count=res.straggler_minmax_count, device=self.device,
        )  # fmt: skip
        # --profile / --record-memory-history: a no-op object by default
        self.profiler = StepProfiler(
            config.profiling, rank=self.rank, world=self.world, device=self.device,
            log_interval=config.logging.log_interval,
        )  # fmt: skip
        self._log_start()

    def _phase(self, name: str, only: type = Exception, iteration: Optional[int] = None):
        """A phase guarded by the failure channel (training/failures.py); ``iteration``: the one
        its failure names (default: the last completed one)."""
        if self.failures is not None:
            self.failures.iteration = self.counters.iteration if iteration is None else iteration
        return guarded(self.failures, name, only)

    def _metrics_logger(self) -> MetricsLogger:
        config, t = self.config, self.config.training
        return MetricsLogger(
            rank=self.rank, world_size=self.world, train_iters=t.train_iters, log=config.logging,
            save_dir=config.checkpoint.save, run_record=config.to_dict(),
            diffusion=config.diffusion.diffusion,
            layout=f"{self.groups.describe()}, {param_count(self.params_per_rank)} params/rank",
            device=self.device,
        )  # fmt: skip

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
            dp_rank=self.groups.dp.rank,
            dp_size=self.groups.dp.size,
            seed=t.seed,
        )
        self.train_loader = loader(
            train_ds, consumed_samples=self.counters.consumed, num_workers=config.data.num_workers
        )
        # Evaluation loaders always start at sample 0: every evaluation reads the same batches, so the numbers
        # compare.
        self.valid_loader = None if valid_ds is None else loader(valid_ds, consumed_samples=0, num_workers=0)
        self.test_loader = None if test_ds is None else loader(test_ds, consumed_samples=0, num_workers=0)

    def _restore(self) -> Optional[str]:
        """Everything from the checkpoint in one call (weights, optimizer, schedule, RNG, counters)."""
        ck, path = self.config.checkpoint, self._resume_from
        if path is None:
            return None
        path, state = self.checkpointer.load(
            path, self.model, self.optimizer, self.scheduler, model_config=self.config.model.to_dict()
        )
        common = state.common
        # --finetune (or a --pretrained-checkpoint start) takes the weights only: iteration, consumed
        # samples and NaN counts start at 0, as in Megatron.
        weights_only = self.checkpointer.weights_only(path)
        if not weights_only:
            if not ck.no_load_rng and not state.rng_restored:
                _log.info(
                    f"RNG states not restored: {path} was saved by {common.get('world_size')} ranks "
                    f"({common.get('parallel', {})}), this run has {self.world} = {self.groups.describe()} "
                    "(the diffusion noise does not depend on them)"
                )
            self.counters.iteration, self.counters.consumed = state.iteration, state.consumed_samples
            self.counters.nan_total = int(state.extra.get("nan_iterations", 0))
            self.counters.skipped_total = int(state.extra.get("skipped_iterations", 0))
            self.rerun.load(state.extra)
        _log.info(
            f"loaded {path} (iteration {state.iteration}, saved by {common.get('wrapper')} on "
            f"{common.get('world_size')} ranks)" + (" as the --finetune start" if weights_only else "")
        )
        return path

    def _log_start(self) -> None:
        c, m = self.config, self.config.model
        _log.info(
            f"megadlms: {_wrapper_name(self.model)} | {self.world} rank(s) = {self.groups.describe()}, "
            f"{dist.get_backend()}, {self.device.type} | GPTModel {self.num_params / 1e6:.2f}M "
            f"params ({param_count(self.params_per_rank)} per rank), {m.num_layers} layers, "
            f"hidden {m.hidden_size}, {m.attention} "
            f"attention, vocab {m.vocab_size} | {c.diffusion.model_running_mode} | global "
            f"batch {self.gbs} = micro {self.mbs} x dp {self.dp_size} x {self.num_micro} accum | "
            f"seq {m.seq_length} | {c.precision}"
        )
        _log.info(
            f"training iterations {self.counters.iteration + 1}..{c.training.train_iters} | "
            f"lr {c.optimizer.lr:g} "
            f"({self.scheduler.lr_decay_style}, warmup "
            f"{self.scheduler.lr_warmup_steps // self.gbs} it)"
        )

    def save(self, non_persistent: bool = False) -> None:
        """Checkpoint the current iteration (with --async-save: after the previous background
        save has finished, and in the background; :meth:`wait_for_save` waits for it);
        ``non_persistent``: Megatron's non-persistent checkpoint (only the newest is kept)."""
        with self._phase("checkpoint save"):  # its metadata (records, extra) is gathered on every rank
            self._save(non_persistent)

    def _save(self, non_persistent: bool) -> None:
        c, n = self.config, self.counters
        self.wait_for_save()
        t0 = time.perf_counter()
        written = self.checkpointer.save(
            n.iteration,
            self.model,
            self.optimizer,
            self.scheduler,
            consumed_samples=n.consumed,
            extra={
                "nan_iterations": n.nan_total,
                "skipped_iterations": n.skipped_total,
                **self.rerun.checkpoint_extra(),
            },
            records=RunRecords(c.to_dict(), c.model.to_dict(), c.data.tokenizer.to_dict()),
            non_persistent=non_persistent,
        )
        self.result.save_stalls.append(time.perf_counter() - t0)
        self.reporter.saved(n, in_background=written is None)
        if written is not None:
            self.result.last_checkpoint = written
            _log.info(f"saved checkpoint {written}")
        else:
            _log.info(f"saving checkpoint iteration {n.iteration} in the background")

    def wait_for_save(self) -> None:
        """Block until the background save in flight (if any) is complete and in place."""
        written = self.checkpointer.wait()
        if written is not None:
            self.result.last_checkpoint = written
            _log.info(f"saved checkpoint {written}")

    def _account(self, out: StepOut, lr: float) -> None:
        """Counters after a step: schedule, NaN/skip counts, the result record."""
        n, limit = self.counters, self.config.training.nan_skip_limit
        it = n.iteration
        if out.nonfinite:
            n.nan_total += 1
            self.result.nan_iterations.append(it)
            _log.warning(
                f"iteration {it}: NaN/Inf loss on some rank; step skipped everywhere ({n.nan_total} so far)"
            )
            if n.nan_total > limit:
                raise RuntimeError(
                    f"loss was NaN/Inf on {n.nan_total} iterations, more than --nan-skip-limit {limit}: "
                    "stopping (lower --lr, check the data, or raise --nan-skip-limit)"
                )
        elif out.success:
            # The schedule counts samples; a step the optimizer skipped (fp16 overflow) does not advance it.
            self.scheduler.step(self.gbs)
        else:
            n.skipped_total += 1
        self.result.losses[it], self.result.lrs[it] = out.loss, lr
        if out.grad_norm is not None:
            self.result.grad_norms[it] = out.grad_norm

    def _rerun_exit(self, decision: RerunExit) -> int:
        """Stop for result validation: save the untouched pre-step state when asked; the
        iteration whose checkpoint now exists (no second save at the end)."""
        _log.warning(f"exiting at iteration {self.counters.iteration}: {decision}")
        if decision.save and self.config.checkpoint.save:
            self.save()
        self.result.exit_reason, self.result.exit_code = "result_validation", decision.code
        return self.counters.iteration

    def _stop_reason(self, out: StepOut) -> Optional[str]:
        # exit_flags were summed over ranks in the step's all-reduce: every rank stops at the same iteration.
        if out.exit_flags[0] > 0:
            return "signal"
        if out.exit_flags[1] > 0:
            return "exit_duration"
        interval = self.config.training.exit_interval
        if interval and self.counters.iteration % interval == 0:
            return "exit_interval"
        return None

    def _maybe_evaluate(self) -> None:
        log = self.config.logging
        if not log.eval_interval or self.counters.iteration % log.eval_interval:
            return
        with self._phase("evaluation"):
            ev = self._evaluate(self.valid_loader)
        if ev is not None:
            self.result.evals[self.counters.iteration] = ev.nelbo
            with self._phase("logging"):
                self.metrics.log_eval(self.counters.iteration, self.counters.consumed, ev)

    def _evaluate(self, loader) -> Optional[Evaluation]:
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
            loss_owner=self.loss_owner,
            pipeline=self.pipeline,
        )
        self.model.train()
        return ev

    def _final_evaluation(self) -> None:
        """Megatron evaluates the validation and the test set once more after training."""
        for name, loader in (("validation", self.valid_loader), ("test", self.test_loader)):
            with self._phase("evaluation"):
                ev = self._evaluate(loader)
            if ev is None:
                continue
            self.result.final_evals[name] = ev.nelbo
            n = self.counters
            prefix = f"iteration {n.iteration} on {name} set"  # Megatron's final-evaluation prefix
            with self._phase("logging"):
                self.metrics.log_eval(n.iteration, n.consumed, ev, prefix=prefix, split=name)

    def _step(self, data_iter, window: ThroughputWindow, exit_flags) -> StepOut:
        """One optimizer step with its accounting and throughput window."""
        t0 = time.perf_counter()
        micro: List[dict] = []  # (left empty by a data error: the step then never reads it)
        data_error: Optional[Exception] = None
        try:
            # Fetch the whole step up front: the global token count N must be known before the first forward.
            micro = [_to_device(next(data_iter), self.device) for _ in range(self.num_micro)]
            if self._packing is not None:
                micro = [self._packing(b) for b in micro]
        except Exception as exc:  # noqa: BLE001 - carried by the step's reductions to every rank
            data_error = exc
        # Read before the step: the logged lr is the one this step used, the scheduler advances after it.
        lr = self.optimizer.param_groups[0]["lr"]
        # Its failures reach every rank in the step's reductions, except where its collectives cannot pair
        # them (UnpairedStepFailure): those go through the failure channel.
        with self._phase("the step", UnpairedStepFailure, self.counters.iteration + 1):
            out = train_step(
                self.model, self.optimizer, micro, self.config.diffusion, self.counters.iteration,
                device=self.device, exit_flags=exit_flags,
                bidirectional=self.config.model.attention != AttnMaskType.CAUSAL, data_error=data_error,
                loss_owner=self.loss_owner, runner=self.runner,
                count_owner=self.loss_owner and self.groups.cp.rank == 0,
                validate=self.rerun.run,  # --rerun-mode: may re-run the step, or raise RerunExit
            )  # fmt: skip
        self.counters.iteration += 1
        if self._compile_to_report:  # once: the first step's time holds the compile
            self._compile_to_report = False
            _log.info(
                f"torch.compile: {compile_seconds():.1f} s compiling (in iteration {self.counters.iteration})"
            )
        # Also for a skipped step: its samples were read, and a resume must not read them again.
        self.counters.consumed += self.gbs
        self._account(out, lr)
        seconds = time.perf_counter() - t0
        with self._phase("logging"):  # the reports below hold collectives (straggler, norms)
            self._report(out, lr, seconds, window)
        return out

    def _report(self, out: StepOut, lr: float, seconds: float, window: ThroughputWindow) -> None:
        self.straggler.after_step(self.counters.iteration, seconds, out.times)
        causal = self.config.model.attention == AttnMaskType.CAUSAL
        # Once per step: the window's throughput and the reporter's running total (--log-progress) share it.
        flops = num_floating_point_operations(self.config.model, self.gbs, out.seq_length, causal=causal)
        # A NaN step would poison the window's mean loss; nan_total counts it instead.
        loss = None if out.nonfinite else out.loss
        window.add(seconds, self.gbs * out.seq_length, flops, loss)
        if self.reporter.after_step(out, lr, flops, self.counters, window):  # True: a progress line
            window.reset()

    def train(self) -> RunResult:
        """Optimizer steps until --train-iters or an exit request; saves as asked."""
        t, ck = self.config.training, self.config.checkpoint
        # Installed only for the loop, which can act on it; the finally below puts the old handler back.
        signal_flag = SignalFlag(t.exit_signal_handler)
        start = time.perf_counter()

        def exit_flags():
            minutes = t.exit_duration_in_mins
            # Each rank reads its own clock; the step's all-reduce of these flags lets the first one stop all.
            over_time = minutes is not None and (time.perf_counter() - start) / 60 > minutes
            return [float(signal_flag.received), float(over_time)]

        window = ThroughputWindow()
        # A resumed run already has a checkpoint of its start iteration: do not write it again at the end.
        last_saved = self.counters.iteration if self.ckpt is not None else None
        assert self.train_loader is not None  # the train split always has data (the config's source rule)
        data_iter = iter(self.train_loader)
        self.model.train()
        try:
            while self.counters.iteration < t.train_iters:
                self.profiler.before_step(self.counters.iteration)
                # --detect-anomaly: names the forward op whose backward made a NaN (slow)
                try:
                    with torch.autograd.detect_anomaly() if t.detect_anomaly else contextlib.nullcontext():
                        out = self._step(data_iter, window, exit_flags)
                except RerunExit as decision:  # result validation: nothing of this step is kept
                    last_saved = self._rerun_exit(decision)
                    break
                self.profiler.after_step(self.counters.iteration)
                self._maybe_evaluate()
                stop = self._stop_reason(out)
                due = self.checkpointer.due(self.counters.iteration)  # persistent, non-persistent or None
                # Any stop saves first (when saving is on): an exit request must not lose the steps since the
                # last save.
                if ck.save and (stop is not None or due is not None):
                    persistent = stop is not None or due == "persistent"
                    self.save(non_persistent=not persistent)
                    if persistent:  # a non-persistent save does not replace the final persistent one
                        last_saved = self.counters.iteration
                if stop is not None:
                    _log.info(f"exiting at iteration {self.counters.iteration} ({stop})")
                    self.result.exit_reason = stop
                    break
            if ck.save and last_saved != self.counters.iteration:
                self.save()
            # Final evaluation only after a full run: a signal or time-limit exit must leave quickly.
            if self.result.exit_reason == "done":
                self._final_evaluation()
            self.wait_for_save()  # the exit waits for a background save
        finally:
            self.profiler.close()
            signal_flag.restore()
            self.metrics.close()
        n = self.counters
        self.result.iteration, self.result.consumed_samples = n.iteration, n.consumed
        self.result.skipped_iterations = n.skipped_total
        return self.result


def _wrapper_name(model: DataParallel) -> str:
    """The data-parallel wrapper's class; a pipeline rank's chunks name their wrapper and count."""
    chunks = model.chunks
    if len(chunks) == 1 and chunks[0] is model:  # one model: the wrapper is its own chunk
        return type(model).__name__
    return f"{type(chunks[0]).__name__} x {len(chunks)} chunk(s)"


def _logical_params(parts, groups, device) -> int:
    """Parameters of the full (unsharded) model (collective over the world): each element once,
    by the rule of the grad and params norms (``sharding.counts_once``)."""
    ranks = {"tp_rank": groups.tp.rank, "dp_rank": groups.dp.rank, "expert_dp_rank": groups.expert_dp.rank}
    total = sum(p.numel() for m in parts for p in m.parameters() if counts_once(p, **ranks))
    if groups.world_size > 1:  # the shards and stages live on different ranks
        # On the collective's device: NCCL takes no CPU tensors (a multi-GPU run would stop here).
        t = torch.tensor([float(total)], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        total = int(t.item())
    return total


def pretrain(
    config: RunConfig,
    *,
    init_model: Optional[Callable[[torch.nn.Module], None]] = None,
    failures: Optional[FailureChannel] = None,
) -> RunResult:
    """Train one run from a :class:`RunConfig` (``megadlms.config.parse_config`` makes one from
    flags); ``init_model``, ``failures``: see :class:`Trainer`."""
    return Trainer(config, init_model=init_model, failures=failures).train()
