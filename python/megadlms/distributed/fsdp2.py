"""TorchFullyShardedDataParallel: PyTorch FSDP2 (``fully_shard``) behind our DDP interface.

FSDP2 shards every parameter on dim 0 across the data-parallel ranks (each parameter
becomes a ``DTensor`` with ``Shard(0)`` placement), all-gathers a *unit* of parameters
just before the unit's forward/backward and reduce-scatters its gradients right after
its backward. Parameters, gradients and optimizer state therefore cost ~1/dp per rank.

This wrapper only decides three things and keeps the interface the training loop uses
for our DDP (the DataParallel protocol, docs/architecture.md):

1. Which submodules are sharding units (``fsdp_unit_modules``; default: every
   ``TransformerLayer``, ``LanguageModelEmbedding``, ``RotaryEmbedding`` that holds
   parameters, and the root's ``output_layer``), matched by class name so this layer
   needs no import from ``megadlms.models``. The root is sharded last and owns the rest
   (e.g. the final layernorm).
2. The mixed-precision policy (:func:`mixed_precision_policy`): fp32 by default; for
   ``--bf16`` parameters are all-gathered and computed in bf16 while the sharded fp32
   parameters stay the optimizer's main copy and gradients are reduced in fp32.
3. Averaging: FSDP2 reduces with ``ReduceOp.AVG`` for fp32/bf16 gradients. Older gloo
   builds summed instead of averaging (pytorch issue 162338). We probe the process
   group once at wrap time; only when it sums do we switch FSDP2 to SUM + post-divide
   (the factors: ``finalize.fsdp2_reduction``). With torch 2.13 the probe finds gloo
   averages correctly (tests check the value). Sum mode: plain SUM, no division.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

import megadlm_ext as ext
from megadlms.common.dtensor import is_dtensor, local_tensor
from megadlms.common.enums import CommBackend, OptimizerLayout
from megadlms.parallel.groups import ParallelGroups
from megadlms.parallel.mappings import reduce_scatter_single

from .comm import build_communicator
from .config import DistributedDataParallelConfig
from .finalize import fsdp2_reduction
from .fsdp2_grid import TensorParallelGradSum, fsdp2_grid
from .fsdp2_units import UnitSpec, select_fsdp_units
from .nan_check import flagged_ranks
from .wrappers import model_wrapper

_log = logging.getLogger(__name__)

FSDP2_MIN_TORCH = (2, 4)


def torch_supports_fsdp2(version: Optional[str] = None) -> bool:
    """True when ``version`` (default: the installed torch) is >= 2.4, the first with FSDP2."""
    v = torch.torch_version.TorchVersion(version if version is not None else torch.__version__)
    return v >= ".".join(map(str, FSDP2_MIN_TORCH))


def require_fsdp2_torch(version: Optional[str] = None) -> None:
    """Raise RuntimeError naming the installed version when FSDP2 is unavailable."""
    if not torch_supports_fsdp2(version):
        have = version if version is not None else torch.__version__
        raise RuntimeError(
            f"FSDP2 requires PyTorch >= 2.4 (found {have}): upgrade torch or drop "
            "use_torch_fsdp2 to use DistributedDataParallel"
        )


def mixed_precision_policy(bf16: bool, grad_reduce_in_fp32: bool = True):
    """The FSDP2 ``MixedPrecisionPolicy`` for ``--bf16`` (None means plain fp32 training).

    bf16: parameters are all-gathered as bf16 and the forward/backward run in bf16; the
    sharded fp32 parameters remain the optimizer's main copy. Gradients are reduced in
    fp32 (``reduce_dtype``) unless ``grad_reduce_in_fp32`` is False.
    """
    if not bf16:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32 if grad_reduce_in_fp32 else torch.bfloat16
    )


def _param_attrs(module: torch.nn.Module) -> dict:
    """Custom Python attributes of every parameter (e.g. ``shared``, ``allreduce``) by name."""
    # remove_duplicate=False: a tied parameter has several names and each new parameter
    # behind those names needs the flags back.
    return {name: dict(vars(p)) for name, p in module.named_parameters(remove_duplicate=False) if vars(p)}


def _restore_param_attrs(module: torch.nn.Module, attrs: dict) -> None:
    # fully_shard replaces each nn.Parameter by a new DTensor parameter; copy our flags over.
    for name, p in module.named_parameters(remove_duplicate=False):
        for key, value in attrs.get(name, {}).items():
            # Keep whatever fully_shard put on the new parameter; restore only what it lacks.
            if not hasattr(p, key):
                setattr(p, key, value)


def _backend_sums_instead_of_averaging(group) -> bool:
    """Probe whether ReduceOp.AVG reduce-scatter really averages on this group.

    gloo in some torch releases silently summed (pytorch issue 162338); one 4-byte-per-rank
    collective at wrap time tells us. Non-gloo backends average natively.
    """
    n = dist.get_world_size(group)
    if n == 1 or dist.get_backend(group) != "gloo":
        return False
    # CPU tensors: only gloo gets here.
    out = torch.empty(1)
    try:  # the single-tensor form FSDP2 itself uses
        reduce_scatter_single(out, torch.ones(n), op=dist.ReduceOp.AVG, group=group)
    except (RuntimeError, ValueError):  # AVG not supported at all: FSDP2 must use SUM
        return True
    # Averaging ones gives 1; a backend that sums gives n.
    return not torch.allclose(out, torch.ones(1))


def fsdp2_config_problems(cfg: DistributedDataParallelConfig, who: str = "FSDP2") -> List[str]:
    """What FSDP2 cannot do with ``cfg``, worded with field names (``who`` names the switch
    that chose FSDP2). The wrapper raises on them; the CLI reports them before launch."""
    problems = []
    if cfg.use_distributed_optimizer:
        problems.append(
            f"{who} is incompatible with use_distributed_optimizer (FSDP2 already shards "
            "optimizer state): drop use_distributed_optimizer"
        )
    elif cfg.overlap_param_gather:
        problems.append(f"{who} gathers parameters itself: drop overlap_param_gather")
    if cfg.comm_backend != CommBackend.TORCH:
        problems.append(
            f"{who} communicates through torch.distributed only: use comm_backend torch "
            f"(got {cfg.comm_backend!r})"
        )
    return problems


@model_wrapper
class TorchFullyShardedDataParallel(torch.nn.Module):
    """FSDP2 data parallelism with the same interface as our DistributedDataParallel.

    Args:
        module: the model (fp32 parameters, on the device the group's backend uses).
        ddp_config: the shared DDP config. FSDP2 shards optimizer state itself, so
            ``use_distributed_optimizer``/``overlap_param_gather`` and ``comm_backend=
            "nccl_ext"`` are rejected; ``bucket_size`` does not apply (a unit's gradients are
            reduced in one collective) and is ignored with a log line; ``check_for_nan_in_grad``
            is honoured in :meth:`finish_grad_sync`; ``grad_reduce_in_fp32`` picks the reduce
            dtype when ``mixed_precision`` is not given.
        process_group: data-parallel group (default: WORLD); the 1-D device mesh comes from it.
        parallel: the run's ``ParallelGroups``. With tensor parallelism (tp > 1) FSDP2 shards
            each TP rank's local parameters over the mesh's dp dimension; with
            ``num_distributed_optimizer_instances`` N > 1 it shards within each of N groups
            of dp/N ranks and replicates across them (HSDP). See ``fsdp2_grid``.
        mixed_precision: a ``MixedPrecisionPolicy`` or None (fp32). See
            :func:`mixed_precision_policy`.
        fsdp_unit_modules: classes or class names to shard as units (see :func:`select_fsdp_units`).
        reshard_after_forward: FSDP2's knob: free gathered parameters after forward (saves
            memory, re-gathers in backward). False (ZeRO-2) also keeps them gathered through
            :meth:`no_sync` micro-batches: one all-gather per unit and step.
        sync_module_states: broadcast rank 0's parameters and buffers before sharding so the
            sharded model equals the model rank 0 built (what our DDP's broadcast does).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        ddp_config: Optional[DistributedDataParallelConfig] = None,
        *,
        process_group=None,
        mixed_precision=None,
        fsdp_unit_modules: Optional[Iterable[UnitSpec]] = None,
        reshard_after_forward: bool = True,
        sync_module_states: bool = True,
        parallel=None,
    ) -> None:
        require_fsdp2_torch()
        super().__init__()
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchFullyShardedDataParallel needs torch.distributed initialised "
                "(launch with torchrun; the trainer calls init_process_group)"
            )
        cfg = ddp_config if ddp_config is not None else DistributedDataParallelConfig()
        problems = fsdp2_config_problems(cfg)
        if problems:
            raise ValueError("; ".join(problems))
        if cfg.bucket_size is not None:
            _log.info("FSDP2: bucket_size is ignored (each unit reduces in one collective)")
        if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecisionPolicy):
            raise ValueError(
                "mixed_precision must be a torch.distributed.fsdp.MixedPrecisionPolicy "
                f"or None, got {type(mixed_precision).__name__}"
            )
        if mixed_precision is None and cfg.grad_reduce_in_fp32:
            # Without a policy FSDP2 reduces in the parameter dtype; this keeps grad_reduce_in_fp32's
            # meaning for models whose params are not fp32.
            mixed_precision = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        self.ddp_config = cfg
        self.mixed_precision = mixed_precision

        device = self._module_device(module)
        grid = fsdp2_grid(parallel, process_group, device.type, cfg.num_distributed_optimizer_instances)
        self.process_group = grid.dp_group
        self.parallel = grid.parallel  # None for plain data parallelism (the optimizer's grid)
        backend = dist.get_backend(self.process_group)
        if device.type == "cpu" and backend == "nccl":
            raise RuntimeError(
                "FSDP2 with the nccl backend needs the model on CUDA: move it with "
                ".cuda() before wrapping, or use distributed_backend gloo on CPU"
            )
        self.mesh = grid.mesh

        if sync_module_states and dist.get_world_size(self.process_group) > 1:
            # Before sharding: afterwards each rank holds a different slice and there are no replicas
            # left to make equal.
            self._broadcast_from_rank0(module)

        self.reshard_after_forward = reshard_after_forward
        self._shard(module, fsdp_unit_modules, reshard_after_forward)
        self.comm = build_communicator(CommBackend.TORCH, self.process_group)
        # Parameters and optimizer state are sharded over all of dp, or within an HSDP instance.
        self.shard_comm = (
            self.comm
            if grid.shard_group is grid.dp_group
            else build_communicator(CommBackend.TORCH, grid.shard_group)
        )
        self._tp_grad_sum = TensorParallelGradSum(module, grid.tp_group)
        # A NaN seen on one TP rank must stop its TP peers too, whose dp groups never saw it.
        self._nan_comm = (
            self.comm if grid.tp_group is None else build_communicator(CommBackend.TORCH, dist.group.WORLD)
        )
        # After _shard: the divide-factor and force-sum setters exist only on sharded modules.
        self._set_reduction(module, cfg, backend)

    def _shard(self, module: torch.nn.Module, fsdp_unit_modules, reshard_after_forward: bool) -> None:
        """``fully_shard`` every unit, then the root (which owns the rest)."""
        from torch.distributed.fsdp import fully_shard

        attrs = _param_attrs(module)
        kw: Dict[str, Any] = dict(mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        if self.mixed_precision is not None:
            kw["mp_policy"] = self.mixed_precision
        units = None if fsdp_unit_modules is None else list(fsdp_unit_modules)
        self.fsdp_units = select_fsdp_units(module, units)
        for unit in self.fsdp_units:
            fully_shard(unit, **kw)
        fully_shard(module, **kw)
        _restore_param_attrs(module, attrs)
        self.module = module

    def _set_reduction(self, module: torch.nn.Module, cfg, backend: str) -> None:
        """Tell FSDP2 how to divide (the factors: ``finalize.fsdp2_reduction``). The AVG probe
        is a collective; sum mode never needs it (no AVG collective)."""
        # The condition is the same on every rank, so all of them or none join the probe.
        self.avg_corrected = not cfg.calculate_per_token_loss and _backend_sums_instead_of_averaging(
            self.process_group
        )
        plan = fsdp2_reduction(
            cfg,
            self.comm.world_size,
            backend_sums_avg=self.avg_corrected,
            can_force_sum=hasattr(module, "set_force_sum_reduction_for_comms"),  # a torch version
        )
        # Each unit runs its own reduce-scatter, so every unit, root included, gets the setting.
        for unit in [*self.fsdp_units, module]:
            if plan.divide_factor is not None:
                unit.set_gradient_divide_factor(plan.divide_factor)
            if plan.force_sum:
                unit.set_force_sum_reduction_for_comms(True)
        self._grad_post_scale = plan.post_scale
        if self.avg_corrected:
            _log.warning(
                "FSDP2: %s backend sums under ReduceOp.AVG (pytorch#162338); correcting so gradients "
                "are averaged",
                backend,
            )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _module_device(module: torch.nn.Module) -> torch.device:
        devices = {t.device for t in list(module.parameters()) + list(module.buffers())}
        if len(devices) > 1:
            raise ValueError(
                f"FSDP2: the module's tensors span devices {sorted(map(str, devices))}; "
                "move the whole model to one device before wrapping"
            )
        return devices.pop() if devices else torch.device("cpu")

    def _broadcast_from_rank0(self, module: torch.nn.Module) -> None:
        src = dist.get_global_rank(self.process_group, 0)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=src, group=self.process_group)

    def _params_with_grad(self) -> list:
        return [p for p in self.module.parameters() if p.grad is not None]

    # ------------------------------------------------------------------ DataParallel protocol
    optimizer_layout = OptimizerLayout.DTENSOR
    grad_buckets: list = []
    parallel: Optional[ParallelGroups] = None  # set in __init__: the groups under tp > 1 or HSDP

    @property
    def chunks(self) -> List[TorchFullyShardedDataParallel]:
        """One model: the one-stage schedule's single chunk is this wrapper."""
        return [self]

    def named_trainable_parameters(self) -> Dict[torch.nn.Parameter, str]:
        names: Dict[torch.nn.Parameter, str] = {}
        for name, p in self.module.named_parameters():
            if p.requires_grad:
                names[p] = name
        return names

    def main_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """The gradient shard (a DTensor) FSDP2 left in ``param.grad``."""
        return param.grad

    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """No-op: FSDP2 all-gathers parameters itself before each unit's forward."""

    def finish_param_sync(self) -> None:
        """No-op: FSDP2's own all-gathers are waited for before each unit's forward/backward,
        and between steps the parameters are the (complete) local shards."""

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (unsharded) without reduce-scatter; the first
        backward after the block reduces the accumulated sum. Without resharding after
        forward the gathered parameters also stay through these backwards, so the next
        micro-batch's forward gathers nothing (the synced last backward frees them)."""
        # On the root only: FSDP2 applies these to every unit below (recurse=True).
        self.module.set_requires_gradient_sync(False)
        if not self.reshard_after_forward:
            self.module.set_reshard_after_backward(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)
            if not self.reshard_after_forward:
                self.module.set_reshard_after_backward(True)

    def start_grad_sync(self) -> None:
        """No-op: FSDP2 launches each unit's reduce-scatter from its post-backward hook."""

    def finish_grad_sync(self) -> None:
        """Make the reduced (averaged) gradient shards final.

        FSDP2's root post-backward callback already waited for the reduce-scatters, so
        ``param.grad`` holds each rank's shard of the averaged gradient. Here: the
        issue-162338 correction when the backend summed and FSDP2 cannot be told to
        divide, the sum over TP of ``tp_partial_grad`` gradients (tensor parallelism), and
        the NaN/Inf check when ``check_for_nan_in_grad`` is set.
        """
        params = self._params_with_grad()
        # The local shards (plain tensors), so the fused ext kernels scale and scan them in place.
        local = [local_tensor(p.grad) for p in params]
        if self._grad_post_scale != 1.0:
            ext.scale_(local, self._grad_post_scale)
        self._tp_grad_sum()
        if self.ddp_config.check_for_nan_in_grad:
            self._agree_on_nan(local)

    def _agree_on_nan(self, local: list) -> None:
        """A NaN/Inf in any rank's reduced shard raises on every rank (one flag all-reduce),
        so no rank runs on into a collective the others never join."""
        bad = bool(local) and ext.has_nonfinite(local)
        # On the mesh's device type: NCCL reduces CUDA tensors only.
        ranks = flagged_ranks(self._nan_comm, float(bad), self.mesh.device_type)
        if not ranks:
            return
        names = [
            n
            for n, p in self.module.named_parameters()
            if p.grad is not None and ext.has_nonfinite([local_tensor(p.grad)])
        ]
        here = f"this rank's shards of {names}" if bad else "this rank's shards are finite"
        raise RuntimeError(
            f"check_for_nan_in_grad: NaN/Inf in reduced FSDP2 gradient shards on rank(s) {ranks}; every "
            f"rank stops. rank {self._nan_comm.rank}: {here}"
        )

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every local gradient shard by ``scaling_factor`` (in place)."""
        local = [local_tensor(p.grad) for p in self._params_with_grad()]
        if local:
            ext.scale_(local, float(scaling_factor))

    def zero_grad_buffer(self) -> None:
        """Drop the gradients (set to None); the next backward writes fresh shards."""
        for p in self.module.parameters():
            p.grad = None

    def broadcast_params(self) -> None:
        """No-op: after sharding each parameter element lives on exactly one rank, so there
        are no replicas to make equal; rank 0's initial values were broadcast before sharding
        (``sync_module_states``)."""

    def state_dict(self, *args, **kwargs):
        """The unwrapped module's keys; values are DTensors (shards + global shape)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load DTensor values as they are, or full tensors (identical on every rank, e.g. from
        a ``--ckpt-format torch`` file) by keeping this rank's dim-0 shard of each."""
        from torch.distributed.tensor import distribute_tensor

        current = self.module.state_dict()
        converted = {}
        for key, value in state_dict.items():
            target = current.get(key)
            if is_dtensor(target) and isinstance(value, torch.Tensor) and not is_dtensor(value):
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(
                        f"load_state_dict: {key} has shape {tuple(value.shape)}, "
                        f"the model expects {tuple(target.shape)}"
                    )
                value = distribute_tensor(
                    value.to(target.device, target.dtype),
                    target.device_mesh,
                    target.placements,
                    # Every rank holds the full value: each slices its own shard locally, no scatter.
                    src_data_rank=None,
                )
            converted[key] = value
        return self.module.load_state_dict(converted, strict=strict, assign=assign)

    def local_model_state_bytes(self) -> dict:
        """Bytes this rank holds for parameter shards and gradient shards (for memory reports)."""
        params = list(self.module.parameters())
        return {
            "params": sum(local_tensor(p).numel() * local_tensor(p).element_size() for p in params),
            "grads": sum(
                local_tensor(p.grad).numel() * local_tensor(p.grad).element_size()
                for p in params
                if p.grad is not None
            ),
        }
