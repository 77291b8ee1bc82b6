"""Result validation: Megatron's rerun state machine (``megatron/core/rerun_state_machine.py``)
around this trainer's step (docs/reliability.md, "Silent faults").

With ``--rerun-mode validate_results`` every rank checks its own results of each step before
the optimizer update -- its loss sum for NaN/Inf (fatal), its per-token loss for a spike and
its gradient norm for an unexpectedly large value (not fatal) -- and one all-reduce tells
every rank whether any rejected one. If so the step's forward/backward runs again on every
rank, on the same micro-batches from the same RNG states (the masking noise is a function
of seed, iteration and sample: it replays by construction), and each rejecting rank compares
its new result with the first one bitwise (a deterministic recomputation must agree):

- not reproduced: a transient fault. Fatal check: the clean pre-step state is saved and the
  job exits 17 (Megatron: 17, resume from the previous checkpoint; saving the untouched
  state loses no steps). Not fatal: training goes on with the re-run's result.
- reproduced: fatal check: a checkpoint of the pre-step state and exit 16 ("resume
  elsewhere to disambiguate"); the resumed job re-runs the step: on the same node again exit
  16, else a different result means the first node computes wrongly and reproducibly
  (persistent error), the same one means the result is correct; both exit 17. Not fatal:
  the reproduced value is reported and training goes on.

Nothing of a rejected step reaches a checkpoint: the optimizer has not stepped, the
counters have not advanced and the RNG states are put back before any save. The first step
of a process is not validated (as in Megatron: a checkpoint must follow an optimizer step).
``report_stats`` re-runs every step once and reports the largest relative difference.
Fault injection (``--error-injection-rate/-type``) follows Megatron's ``RerunErrorInjector``:
it rejects a result and decides what the comparisons then say, without touching numbers.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import os
import random
import socket
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from megadlms.checkpoint.rng import rng_state, set_rng_state
from megadlms.common.dtensor import local_tensor
from megadlms.config import ResilienceConfig

from .step import StepGrads

_log = logging.getLogger("megadlms.training")

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16  # Megatron's: checkpoint saved, resume (elsewhere) to diagnose
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17  # Megatron's: stop, result validation failed
SAMPLES_FOR_MAX = 100  # Megatron's is_unexpectedly_large(num_samples=100)
LARGE_GRADS_FACTOR = 10.0  # Megatron's check_grads threshold


class RerunExit(Exception):
    """The machine's decision to stop the run: exit ``code``; ``save``: checkpoint the
    (untouched) pre-step state first."""

    def __init__(self, code: int, save: bool, reason: str) -> None:
        super().__init__(f"{reason} (exit code {code})")
        self.code, self.save, self.reason = code, save, reason


@dataclasses.dataclass
class _Check:
    message: str
    fatal: bool
    value: float


@dataclasses.dataclass
class _Suspect:
    """What a rejecting rank remembers of its rejected result (checkpointed with exit 16)."""

    message: str
    fatal: bool
    evidence: List[float]
    injected: Optional[str] = None  # the injected fault type, while it still decides comparisons
    node: str = ""


def node_name(device: torch.device) -> str:
    """This rank's node and device, as the diagnosis records them (``$MEGADLMS_NODE_NAME``
    overrides the host name: a scheduler's node id, or a test standing for another node)."""
    host = os.environ.get("MEGADLMS_NODE_NAME") or socket.gethostname()
    index = torch.cuda.current_device() if device.type == "cuda" else "cpu"
    return f"{host}:{index}"


def local_grad_norm(model) -> float:
    """L2 norm of the gradients this rank holds (the main grads the optimizer reads; the
    local shard of a DTensor): Megatron's per-bucket grad norm, after the reduction."""
    grads = []
    for chunk in model.chunks:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                grads.append(local_tensor(g).detach().float().norm())
    return float(torch.stack(grads).norm()) if grads else 0.0


class _Injector:
    """Megatron's RerunErrorInjector, with a decision that is a function of (seed, iteration,
    rank, call): reproducible, and the default RNG streams are never drawn from."""

    def __init__(self, rate: int, kind: str, seed: int, rank: int) -> None:
        self.rate, self.kind, self.seed, self.rank = rate, kind, seed, rank

    def inject(self, iteration: int, call: int) -> bool:
        if self.rate <= 0:
            return False
        draw = random.Random(self.seed * 1_000_003 + iteration * 101 + call).randrange(self.rate)
        return (draw + self.rank) % self.rate == 0


class RerunMachine:
    """Validates each step's results and re-runs suspicious steps (module docstring).
    ``run(fb, iteration)`` replaces a plain ``fb()``, where ``fb`` runs the step up to its
    optimizer update and returns its :class:`~.step.StepGrads`; it may raise
    :class:`RerunExit`. All decisions come from all-reduces over ``group``: every rank takes
    the same path."""

    def __init__(
        self, config: ResilienceConfig, *, check_nan: bool, model, seed: int, device: torch.device,
        rng_tracker=None, group=None, log_interval: int = 100,
    ) -> None:  # fmt: skip
        self.config, self.check_nan, self.model = config, check_nan, model
        self.device, self.rng_tracker, self.group = device, rng_tracker, group
        self.rank = dist.get_rank()
        self.node = node_name(device)
        self.injector = _Injector(config.error_injection_rate, config.error_injection_type, seed, self.rank)
        self.history: Dict[str, List[float]] = {}  # context -> [values seen, max of the first 100]
        self.first_done = False
        self.from_checkpoint: Optional[_Suspect] = None  # this rank's suspect, resumed after exit 16
        self.resumed = False  # a step checkpointed with exit 16 is the next to run
        self.log_interval = log_interval
        self.max_diff = 0.0

    # -- the step ------------------------------------------------------------------------

    def run(self, fb: Callable[[], StepGrads], iteration: int) -> StepGrads:
        """The step's :class:`StepGrads`, validated (``iteration``: completed steps before it)."""
        mode = self.config.rerun_mode
        if mode == "disabled":
            return fb()
        if self.resumed:
            return self._rerun_from_checkpoint(fb, iteration)
        saved = rng_state(self.rng_tracker)
        grads = fb()
        evidence = self._evidence(grads)
        if mode == "report_stats":
            return self._report_stats(fb, saved, evidence, iteration)
        suspect = self._validate(evidence, iteration) if self.first_done else None
        self.first_done = True
        if not self._any([suspect is not None])[0]:
            return grads
        if suspect is not None:
            how = f"injected {suspect.injected}" if suspect.injected else "rejected"
            self._report(iteration, "initial_run", f"result {how}; re-running the step", evidence, suspect)
        else:
            _log.warning(
                f"rank {self.rank}: iteration {iteration + 1}: another rank rejected its result; re-running"
            )
        set_rng_state(saved, self.rng_tracker)
        again = fb()
        return self._decide_in_place(again, suspect, saved, iteration)

    def _decide_in_place(self, again: StepGrads, suspect, saved, iteration: int) -> StepGrads:
        """After the re-run on the same node: go on, checkpoint and exit 16, or exit 17."""
        go_on = checkpoint = False
        if suspect is not None:
            evidence = self._evidence(again)
            same = self._compare(suspect, evidence, in_place=True)
            if not same:
                self._report(
                    iteration,
                    "first_rerun_not_reproducible",
                    "not reproducible: possible transient error",
                    evidence,
                    suspect,
                )
                go_on = not suspect.fatal
            else:
                self._report(
                    iteration,
                    "first_rerun_reproducible",
                    "reproducible: re-run on another node to tell a correct result from a persistent error",
                    evidence,
                    suspect,
                )
                go_on, checkpoint = not suspect.fatal, suspect.fatal
        go_on, checkpoint = self._any([go_on, checkpoint])
        if go_on:
            _log.warning(f"iteration {iteration + 1}: the failed validation was not fatal; continuing")
            return again
        set_rng_state(saved, self.rng_tracker)  # a save below records the untouched pre-step state
        if checkpoint:
            self.from_checkpoint = suspect
            raise RerunExit(
                EXIT_CODE_RESUME_TO_DISAMBIGUATE, True, "result reproduced: checkpointed to re-run elsewhere"
            )
        raise RerunExit(
            EXIT_CODE_FAILED_ON_RESULT_VALIDATION, True, "transient error: result not reproducible"
        )

    def _rerun_from_checkpoint(self, fb, iteration: int) -> StepGrads:
        """The first step after a resume from an exit-16 checkpoint: the second re-run."""
        self.resumed, self.first_done = False, True
        suspect, self.from_checkpoint = self.from_checkpoint, None
        grads = fb()
        again = same_node = go_on = False
        if suspect is not None:
            evidence = self._evidence(grads)
            if suspect.node == self.node:
                same_node = True
                self._report(
                    iteration,
                    "rerun_on_same_node",
                    f"rescheduled on the same node {self.node}: resume again elsewhere",
                    evidence,
                    suspect,
                )
            elif not self._compare(suspect, evidence, in_place=False):
                self._report(
                    iteration,
                    "second_rerun_not_reproducible",
                    f"not reproducible on {self.node}: possible persistent error on {suspect.node}",
                    evidence,
                    suspect,
                )
                go_on = not suspect.fatal
            else:
                self._report(
                    iteration,
                    "second_rerun_reproducible",
                    f"reproduced on {self.node}: the result is correct (possible application error)",
                    evidence,
                    suspect,
                )
                go_on = not suspect.fatal
            again = same_node
        again, go_on = self._any([again, go_on])
        if again:
            self.from_checkpoint = suspect
            raise RerunExit(
                EXIT_CODE_RESUME_TO_DISAMBIGUATE, False, "re-run on the same node: resume again elsewhere"
            )
        if go_on:
            return grads
        raise RerunExit(EXIT_CODE_FAILED_ON_RESULT_VALIDATION, False, "result validation failed (diagnosed)")

    # -- checks --------------------------------------------------------------------------

    def _evidence(self, grads: StepGrads) -> List[float]:
        """[loss sum, loss tokens, gradient norm (with --check-for-large-grads)] of this rank."""
        ev = [float(grads.local_loss), grads.local_tokens]
        if self.config.check_for_large_grads:
            ev.append(local_grad_norm(self.model))
        return ev

    def _checks(self, evidence: List[float]) -> List[_Check]:
        loss, tokens = evidence[0], evidence[1]
        out = []
        if self.check_nan:
            out.append(_Check("found NaN in local forward loss calculation", True, loss))
            out.append(_Check("found Inf in local forward loss calculation", True, loss))
        if self.config.check_for_spiky_loss:
            out.append(_Check("Spiky loss", False, loss / tokens if tokens > 0 else 0.0))
        if self.config.check_for_large_grads:
            out.append(_Check("found unexpected large grads", False, evidence[2]))
        return out

    def _rejects(self, check: _Check) -> bool:
        v = check.value
        if check.message.startswith("found NaN"):
            return math.isnan(v)
        if check.message.startswith("found Inf"):
            return math.isinf(v)
        context = "loss" if check.message == "Spiky loss" else "grads"
        factor = self.config.spiky_loss_factor if context == "loss" else LARGE_GRADS_FACTOR
        return self._unexpectedly_large(context, v, factor)

    def _unexpectedly_large(self, context: str, value: float, factor: float) -> bool:
        """Megatron's is_unexpectedly_large: the first 100 values set the max, later ones are
        judged against factor x max (NaN/Inf are the other checks' business)."""
        value = abs(value)
        if not math.isfinite(value):
            return False
        seen, top = self.history.get(context, [0.0, 0.0])
        if seen < SAMPLES_FOR_MAX:
            self.history[context] = [seen + 1, max(top, value)]
            return False
        return value >= top * factor

    def _validate(self, evidence: List[float], iteration: int) -> Optional[_Suspect]:
        for call, check in enumerate(self._checks(evidence)):
            injected = self.injector.inject(iteration, call)
            if injected or self._rejects(check):
                kind = self.config.error_injection_type if injected else None
                if injected:
                    _log.warning(f"rank {self.rank}: injecting error type {kind} ({check.message})")
                return _Suspect(check.message, check.fatal, list(evidence), kind, self.node)
        return None

    def _compare(self, suspect: _Suspect, evidence: List[float], *, in_place: bool) -> bool:
        """Bitwise equality of the evidence; an injected fault decides as Megatron's
        ``maybe_miscompare`` (transient: differs in place; persistent: differs elsewhere)."""
        if suspect.injected is not None:
            kind = suspect.injected
            if in_place:
                return kind != "transient_error"
            suspect.injected = None
            return kind == "correct_result"
        return all(_same(a, b) for a, b in zip(suspect.evidence, evidence))

    def _any(self, flags: List[bool]) -> List[bool]:
        t = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return [x > 0 for x in t.tolist()]

    # -- reporting -----------------------------------------------------------------------

    def _report(self, iteration: int, status: str, what: str, evidence, suspect: _Suspect) -> None:
        """The decision and its evidence, on this rank's log (and the tracker file)."""
        shown = ", ".join(f"{x!r} ({float(x).hex()})" for x in evidence)
        first = ", ".join(f"{float(x).hex()}" for x in suspect.evidence)
        line = (
            f"rank {self.rank}, node {self.node}, iteration {iteration + 1}: {suspect.message}: {what} "
            f"[status {status}; [loss sum, loss tokens(, grad norm)] now {shown}; first {first}]"
        )
        (_log.error if suspect.fatal else _log.warning)(line)
        path = self.config.result_rejected_tracker_filename
        if path:
            with open(path, "a") as f:
                f.write(
                    f"ts={datetime.datetime.now()} node={self.node} jobID={os.getenv('SLURM_JOBID', 'N/A')} "
                    f"rank={self.rank} iteration={iteration + 1} status={status} "
                    f"result={evidence[0]!r} message='{suspect.message}'\n"
                )

    def _report_stats(self, fb, saved, evidence, iteration: int) -> StepGrads:
        """report_stats: re-run every step once; the largest relative difference since the
        last report, all-reduced (MAX), every log interval on rank 0."""
        after = rng_state(self.rng_tracker)
        set_rng_state(saved, self.rng_tracker)
        again = fb()
        set_rng_state(after, self.rng_tracker)
        diff = max((_relative(a, b) for a, b in zip(evidence, self._evidence(again))), default=0.0)
        self.max_diff = max(self.max_diff, diff)
        if (iteration + 1) % self.log_interval == 0:
            t = torch.tensor([self.max_diff], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
            if self.rank == 0:
                _log.info(f"iteration {iteration + 1}: determinism stats: largest relative difference "
                          f"of a re-run step's [loss, tokens(, grad norm)] {float(t):.3g}")  # fmt: skip
            self.max_diff = 0.0
        return again

    # -- checkpoint ----------------------------------------------------------------------

    def checkpoint_extra(self) -> dict:
        """The machine's part of a checkpoint's ``extra`` ({} when disabled: today's bytes).
        Per-rank state is gathered (a collective: every rank calls it, as every rank saves)."""
        if not self.config.validating:
            return {}
        mine: Dict[str, Any] = {"history": self.history, "suspect": None}
        if self.from_checkpoint is not None:
            s = self.from_checkpoint
            evidence: List[str] = [float(x).hex() for x in s.evidence]  # exact floats as text
            mine["suspect"] = {**dataclasses.asdict(s), "evidence": evidence}
        ranks: List[Optional[dict]] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(ranks, mine, group=self.group)
        return {"rerun_state": {"mode": self.config.rerun_mode, "ranks": ranks}}

    def load(self, extra: dict) -> None:
        """Restore what :meth:`checkpoint_extra` saved; a pending re-run is the next step."""
        state = extra.get("rerun_state")
        if state is None:
            return
        if not self.config.validating:
            _log.warning("--rerun-mode disabled: the checkpoint's rerun state is ignored")
            return
        ranks = state["ranks"]
        if len(ranks) != dist.get_world_size(self.group):
            raise ValueError(
                f"the checkpoint's rerun state was saved by {len(ranks)} ranks, this run has "
                f"{dist.get_world_size(self.group)}: resume at that world size to finish the diagnosis"
            )
        mine = ranks[self.rank]
        self.history = {k: list(v) for k, v in mine["history"].items()}
        pending = any(r["suspect"] is not None for r in ranks)
        if mine["suspect"] is not None:
            s = dict(mine["suspect"])
            s["evidence"] = [float.fromhex(x) for x in s["evidence"]]
            self.from_checkpoint = _Suspect(**s)
        self.resumed = pending
        if pending:
            _log.warning("the checkpoint holds a step to re-run for result validation: re-running it first")


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or float(a).hex() == float(b).hex()


def _relative(a: float, b: float) -> float:
    """Megatron's _compare_floats: 0 when equal, inf when only one is NaN/Inf."""
    if _same(a, b):
        return 0.0
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs((a - b) / (a + b) * 2) if a + b else math.inf
