"""Megatron-style DistributedDataParallel: contiguous grad buckets reduced while backward runs.

Flow of one step (docs/architecture.md, "The way a gradient travels"):

1. Wrap time: trainable parameters go into one :class:`ParamAndGradBuffer` per
   (param dtype, grad dtype); ``param.main_grad`` views the buffer. Frozen parameters
   are left out; a parameter registered twice (tied weights) appears once.
2. Backward: a post-accumulate-grad hook marks each parameter ready. When the last
   parameter of a bucket is ready, its gradients are folded into the buffer:
   * grad dtype != param dtype (bf16/fp16 params, ``grad_reduce_in_fp32``): one
     ``megadlm_ext.accumulate_into`` call per bucket casts, scales (1/dp when averaging,
     1 in sum mode) and adds all the bucket's ``param.grad`` into the buffer, frees them;
   * same dtype: ``param.grad`` IS the ``main_grad`` view (set at wrap time and by
     ``zero_grad_buffer``), so autograd already accumulated in place (zero copy, as
     torch DDP's ``gradient_as_bucket_view``); when averaging, the bucket is scaled by
     1/dp with one ``megadlm_ext.scale_`` call just before its collective. (Freeing per-parameter
     grads mid-backward instead made glibc return the memory to the OS and page-fault
     it back every step: +45% step time on CPU.) A grad that is not the view (e.g. set
     to None by ``torch.optim``'s ``zero_grad``) is folded by ``accumulate_into``.
   With ``overlap_grad_reduce`` the bucket's collective (all-reduce; reduce-scatter with
   the distributed optimizer) is then launched asynchronously, strictly in bucket order
   on every rank (a bucket that is ready early waits for its predecessors) within each
   reduce group (dense buckets and expert buckets keep separate orders).
3. ``finish_grad_sync()`` folds what is left (buckets that never became complete, e.g.
   with an unused parameter, whose missing gradients count as zeros — Megatron asserts
   instead), launches every remaining collective in order and waits. Then
   ``param.main_grad`` holds the reduced gradient; so does ``param.grad`` (the same
   view) in plain DDP when the dtypes match, so any torch.optim works.

Gradient-accumulation fusion (``ColumnParallelLinear``/``RowParallelLinear`` with
``gradient_accumulation_fusion=True``): the layer adds its weight gradient into
``main_grad`` itself (times ``param.main_grad_scale``, the fold's scale) and sets
``param.grad_added_to_main_grad``; the hook then marks the parameter ready without folding
it (Megatron's scheme; parallel/linear_impl.py).

Inside ``no_sync()`` buckets are folded, never communicated: the next backward adds to them.

Over a tensor-parallel grid (``parallel=ParallelGroups``) the wrapper reduces over
``parallel.dp`` only: each TP rank's buffers hold its local shards, and TP peers build
identical buffer layouts (same local shapes, same dp coordinate, so the same shard ranges).
``finish_grad_sync`` then sums over ``parallel.tp`` the gradients of parameters whose
``ParamSharding.tp_partial_grad`` is set (replicated, but each TP rank saw only its sequence chunk), and the
NaN agreement spans the whole world. With ``num_distributed_optimizer_instances`` N > 1 a
bucket is reduce-scattered within ``parallel.dp_intra`` (dp/N consecutive dp ranks) and this
rank's shard all-reduced across ``parallel.dp_inter``; the updated shards are all-gathered
within the instance.

Expert parameters (``ParamSharding.expert_dim`` set) live in buffers of their own whose buckets
are reduced (and, with the distributed optimizer, sharded) over ``parallel.expert_dp``;
every bucket carries its ``reduce_group`` (communicators and fold scale, ddp_groups.py).
An expert that got no token in a step has a zero gradient and still joins every collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Dict, List, Optional

import torch
import torch.distributed as dist

import megadlm_ext as ext
from megadlms.common.collectives import Handle
from megadlms.common.enums import CommBackend, OptimizerLayout
from megadlms.common.ranges import grad_sync, traced
from megadlms.parallel.sharding import is_expert_param, sharding_of

from .comm import build_communicator, resolve_group, sum_in_place
from .config import DistributedDataParallelConfig
from .ddp_groups import data_parallel_group, instance_communicators, reduce_groups
from .grad_fold import check_placeholder, fold_bucket, foreign_grad, weak_hook
from .nan_check import agree_on_nan
from .param_and_grad_buffer import Bucket, ParamAndGradBuffer
from .param_gather import ParamGather
from .wrappers import model_wrapper, unwrap_model

if TYPE_CHECKING:  # the bottom layer; imported for the annotation only
    from megadlms.parallel import ParallelGroups


@model_wrapper
class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper with Megatron-core's grad buffers, buckets and overlap.

    Args:
        module: the model (any ``nn.Module``; a ``Float16Module`` for bf16/fp16 training).
        ddp_config: bucketing/overlap/precision knobs; defaults to ``DistributedDataParallelConfig()``.
        process_group: data-parallel group; WORLD when None (one process if none is initialised).
        parallel: the run's ``ParallelGroups`` (tensor-parallel grid): the data-parallel group
            is ``parallel.dp.group``; ``sequence_parallel`` grads are summed over
            ``parallel.tp``; distributed-optimizer instances use ``parallel.dp_intra`` /
            ``dp_inter``. None: plain data parallelism over ``process_group``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        ddp_config: Optional[DistributedDataParallelConfig] = None,
        *,
        process_group=None,
        parallel: Optional[ParallelGroups] = None,
    ) -> None:
        super().__init__()
        self.module = module
        # A copy: bucket_size is filled in below, and the caller's config may be shared by
        # several chunks.
        cfg = dataclasses.replace(ddp_config) if ddp_config is not None else DistributedDataParallelConfig()
        self.parallel = parallel
        self.process_group = data_parallel_group(process_group, parallel)
        self.comm = build_communicator(cfg.comm_backend, self.process_group)
        self.dp_size, self.dp_rank = self.comm.world_size, self.comm.rank
        # shard_comm: the ranks one bucket is sharded over; inter_comm: across instances.
        self.shard_comm, self.inter_comm = instance_communicators(cfg, parallel, self.comm)
        if cfg.bucket_size is None and cfg.overlap_grad_reduce:
            # Megatron's default. It grows with dp so that each rank's reduce-scatter shard of a
            # bucket stays big enough (~1M elements) for the collective to run at bandwidth.
            cfg.bucket_size = max(40_000_000, 1_000_000 * self.dp_size)
        self.ddp_config = cfg
        # Sum mode (calculate_per_token_loss): plain SUM, the caller normalises. Averaging:
        # ReduceOp.AVG when asked for and available, else pre-divide by dp (same average);
        # expert buckets over expert_dp with Megatron's scale (ddp_groups.py).
        self._dense, self._expert = reduce_groups(cfg, parallel, self.comm, self.shard_comm, self.inter_comm)
        self._nan_flags: List[tuple] = []  # (bucket, device NaN/Inf flag) of the step, read once

        names: Dict[torch.nn.Parameter, str] = {}
        # names as in the unwrapped model (checkpoint and optimizer keys); tied weights once
        for name, p in unwrap_model(module).named_parameters():
            if p.requires_grad:
                names[p] = name
        groups: Dict[tuple, List[torch.nn.Parameter]] = {}
        for p in names:  # dense buffers first, then the expert ones (Megatron's order)
            # fp32 reduction of bf16/fp16 grads: the sum over dp ranks is not rounded at each hop.
            # The buffer dtype then differs from the param's, so those grads are folded, not viewed.
            gdtype = torch.float32 if cfg.grad_reduce_in_fp32 else p.dtype
            groups.setdefault((is_expert_param(p), p.dtype, gdtype), []).append(p)
        self.buffers_: List[ParamAndGradBuffer] = []
        self.buckets: List[Bucket] = []
        # sorted() is stable: dense before expert, registration order within each, so every
        # rank (and every TP peer) derives the same buffers and buckets.
        for (expert, _, gdtype), params in sorted(groups.items(), key=lambda kv: kv[0][0]):
            group = self._expert if expert else self._dense
            buf = ParamAndGradBuffer(
                params,
                [names[p] for p in params],
                grad_dtype=gdtype,
                bucket_size=cfg.bucket_size,
                dp_size=group.shard_comm.world_size,  # buckets split into this many shards
                use_distributed_optimizer=cfg.use_distributed_optimizer,
                first_bucket_index=len(self.buckets),
            )
            for bucket in buf.buckets:
                bucket.reduce_group = group
            self.buffers_.append(buf)
            self.buckets.extend(buf.buckets)
        self.param_names = names
        # Whole-buffer ops (the 1/dp scale of a view bucket, its NaN check, scale_gradients) run
        # on TensorTables built once: the buffers live as long as the wrapper and are only ever
        # written in place (zero_(), the kernels, the collectives), which is what a table needs.
        self._buffers_table = ext.TensorTable([b.grad_data for b in self.buffers_])
        for bucket in self.buckets:
            bucket.grad_table = ext.TensorTable([bucket.grad_data])
        self._grid_comms(cfg, parallel)
        self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self._sync_enabled = True
        # Launch order: strictly in bucket order within each reduce group (dense, expert), so
        # every rank issues each group's collectives in the same order, while an expert bucket
        # that is ready early need not wait for the dense ones (Megatron's bucket groups).
        self._order = {k: [b for b in self.buckets if b.reduce_group.expert == k] for k in (False, True)}
        self._next_launch = {False: 0, True: 0}
        # Before the first backward: if param.grad did not already view the buffer, autograd
        # would allocate a fresh grad and the zero-copy path would be lost for that step.
        self._attach_grad_views()
        # Post-accumulate: fires once per backward after autograd has summed every use of the
        # parameter (tied or reused weights included), so its gradient is complete here.
        # The hook reaches the wrapper through a weak reference: a parameter that held the
        # wrapper would close a cycle through a tensor, which Python's gc cannot see into, so
        # the model, its buffers and its process groups would outlive every run in a process.
        hook = weak_hook(self._on_grad_ready)
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in names]
        overlap_gather = cfg.use_distributed_optimizer and cfg.overlap_param_gather
        self._gather = ParamGather(module, self.buckets, names, overlap_gather)
        self._hooks += self._gather.hooks
        # state_dict() of the wrapper or of the unwrapped module (checkpointing) never sees
        # half-gathered parameters (param_gather.py: the invariant).
        # Keyed by id: without a Float16Module the wrapped and unwrapped module are one object,
        # which gets one hook.
        for m in {id(module): module, id(unwrap_model(module)): unwrap_model(module)}.values():
            self._hooks.append(m.register_state_dict_pre_hook(lambda *a, **k: self.finish_param_sync()))

    # ------------------------------------------------------------------ DataParallel protocol
    @property
    def optimizer_layout(self) -> OptimizerLayout:
        """BUCKET_SHARDS with the distributed optimizer, else REPLICATED (protocol.py)."""
        sharded = self.ddp_config.use_distributed_optimizer
        return OptimizerLayout.BUCKET_SHARDS if sharded else OptimizerLayout.REPLICATED

    @property
    def grad_buckets(self) -> List[Bucket]:
        return self.buckets

    @property
    def chunks(self) -> List[DistributedDataParallel]:
        """One model: the one-stage schedule's single chunk is this wrapper."""
        return [self]

    def named_trainable_parameters(self) -> Dict[torch.nn.Parameter, str]:
        return dict(self.param_names)

    def main_grad(self, param: torch.nn.Parameter) -> Optional[torch.Tensor]:
        """The reduced gradient of ``param``: its view of the grad buffer."""
        return getattr(param, "main_grad", None) if param in self.param_names else param.grad

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _attach_grad_views(self) -> None:
        """param.grad = main_grad view where the dtypes match (autograd accumulates in place).

        ``param.main_grad_scale`` is the factor a fold applies to that parameter's gradient;
        layers with gradient-accumulation fusion (parallel/linear_impl.py) add their weight
        gradient into ``main_grad`` times it themselves."""
        for bucket in self.buckets:
            for p in bucket.params:
                p.grad = p.main_grad if bucket.grad_view else None  # type: ignore[attr-defined]
                # the fold scale (finalize.bucket_fold_scales) passed down to the fused kernels;
                # a view bucket is scaled as a whole before its collective instead
                p.main_grad_scale = 1.0 if bucket.grad_view else bucket.reduce_group.fold_scale  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ grad sync
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        bucket = self._bucket_of[param]
        self._gather.check_read(param)
        # A late gradient would be added into a buffer the collective is already reading (or
        # has reduced): the step's numbers would depend on timing.
        if bucket.launched:
            raise RuntimeError(
                f"parameter {self.param_names[param]} got a gradient after bucket {bucket.index}'s "
                "collective was launched: run one backward per step outside no_sync(), and call "
                "zero_grad_buffer() (or optimizer.zero_grad()) before the next step"
            )
        fused = getattr(param, "grad_added_to_main_grad", False)
        if bucket.stale and param not in bucket.written:
            if fused:  # added onto last step's values: the zeroing it needed was deferred
                raise RuntimeError(
                    f"parameter {self.param_names[param]}: gradient-accumulation fusion added into a "
                    "main_grad whose zeroing was deferred (its bucket had no fused gradient in earlier "
                    "steps); keep fusion on or off for a weight from its first step, or pass "
                    "--no-gradient-accumulation-fusion"
                )
            bucket.write_first(param, last_micro_batch=self._sync_enabled)
        if fused:
            bucket.fused_seen = True
            # Fused weight gradient (linear_impl.py): already in main_grad; param.grad holds
            # only the placeholder that made this hook run: drop it unfolded. With
            # zero_out_wgrad the placeholder is a zero summed with an ordinary gradient
            # (tied weights): fold that as usual.
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
            if not getattr(param, "zero_out_wgrad", False):
                check_placeholder(param, self.param_names[param])
                param.grad = param.main_grad if bucket.grad_view else None  # type: ignore[attr-defined]
        bucket.ready.add(param)
        # Folding is per bucket, launching is not: the launch goes through the ordered queue so
        # that every rank issues the collectives in the same order (else NCCL deadlocks).
        if len(bucket.ready) == len(bucket.params):
            # Every gradient of the bucket arrived and none was fused: later steps may defer
            # its zeroing (param_and_grad_buffer.Bucket.zero_or_defer).
            bucket.defer_ok = not bucket.fused_seen
            fold_bucket(bucket, self._sync_enabled)
            if self._sync_enabled and self.ddp_config.overlap_grad_reduce:
                self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        for kind, order in self._order.items():
            # Only the folded prefix goes out: a bucket ready early waits behind an unfolded one.
            while self._next_launch[kind] < len(order) and order[self._next_launch[kind]].folded:
                self._launch(order[self._next_launch[kind]])

    def _launch(self, bucket: Bucket) -> None:
        if self.ddp_config.check_for_nan_in_grad:
            # Checked before the collective: afterwards a NaN has spread to every rank and the
            # rank that produced it can no longer be named.
            self._check_nan(bucket)
        group = bucket.reduce_group
        # A view bucket's grads came straight from autograd (no fold to scale them), so the
        # factor is applied here, once, over the whole bucket after its last micro-batch.
        if bucket.grad_view and group.fold_scale != 1.0 and not bucket.prescaled:
            ext.scale_(bucket.grad_table, group.fold_scale)  # 1/dp before a SUM collective
        if self.ddp_config.use_distributed_optimizer:
            lo, hi = self._shard_range(bucket)
            # In place: the output is this rank's slice of the input, so the reduced shard lands
            # where the optimizer reads it; the rest of grad_data is left unreduced (not valid).
            with traced(grad_sync(bucket.index, "reduce-scatter")):
                bucket.handle = group.shard_comm.reduce_scatter(
                    bucket.grad_data[lo:hi], bucket.grad_data, group.op, async_op=True
                )
        else:
            with traced(grad_sync(bucket.index, "all-reduce")):
                bucket.handle = group.comm.all_reduce(bucket.grad_data, group.op, async_op=True)
        bucket.launched = True
        self._next_launch[group.expert] += 1

    def _shard_range(self, bucket: Bucket):
        """This rank's shard of ``bucket`` (distributed optimizer; within its instance, or its
        expert-data-parallel group)."""
        shard = bucket.reduce_group.shard_comm
        return bucket.shard_range(shard.rank, shard.world_size)

    def _grid_comms(self, cfg: DistributedDataParallelConfig, parallel) -> None:
        """The grid's extra communicators: the TP group for ``sequence_parallel`` grads (only
        when some exist) and the world for the NaN agreement."""
        tp_size = parallel.tp.size if parallel is not None else 1
        self._sp_params = [p for p in self.param_names if sharding_of(p).tp_partial_grad]
        self._tp_comm = None
        if tp_size > 1 and self._sp_params:
            self._tp_comm = build_communicator(CommBackend.TORCH, parallel.tp.group)
        self._world_comm = None
        if parallel is not None and cfg.check_for_nan_in_grad:
            self._world_comm = build_communicator(CommBackend.TORCH, resolve_group(None))

    def _allreduce_sequence_parallel_grads(self) -> None:
        """Sum over TP the main_grad of every ``sequence_parallel`` parameter (one all-reduce
        per grad dtype). With the distributed optimizer only this rank's shard of a grad is
        valid; TP peers own the same shard ranges, so the valid parts are summed together."""
        if self._tp_comm is None:
            return
        sum_in_place(self._tp_comm, [p.main_grad for p in self._sp_params])  # type: ignore[attr-defined]

    def _check_nan(self, bucket: Bucket) -> None:
        """Queue this rank's NaN/Inf check of ``bucket`` before its collective as a device flag
        (no host sync inside backward: buckets keep overlapping); ``_agree_on_nan`` reads the
        flags once after the step. Raising here would leave the other ranks waiting."""
        self._nan_flags.append((bucket, ext.nonfinite_flag(bucket.grad_table)))

    def _agree_on_nan(self) -> None:
        """One flag all-reduce after the step's collectives (``nan_check.agree_on_nan``): a
        NaN/Inf on any rank raises on every rank. Over a grid (``parallel``) the flags span the
        world: a NaN on one TP rank stops its TP peers, whose data-parallel groups never saw it."""
        world = self._world_comm is not None
        checked, self._nan_flags = self._nan_flags, []
        agree_on_nan(
            self._world_comm if world else self.comm,
            checked,
            self.buckets[0].grad_data.device,
            where="rank(s)" if world else "data-parallel rank(s)",
            dp_rank=self.dp_rank,
        )

    def start_grad_sync(self) -> None:
        """Fold any pending gradients and launch every bucket's collective not yet launched."""
        pending = [b for kind, order in self._order.items() for b in order[self._next_launch[kind] :]]
        # Each group's unlaunched tail, still in bucket order (with overlap the head has gone).
        for bucket in pending:
            # Also re-fold a folded bucket whose param.grad was replaced since (not the view):
            # that tensor holds gradient the buffer does not have yet.
            if not bucket.folded or any(foreign_grad(p) is not None for p in bucket.params):
                # an incomplete bucket: missing gradients contribute zeros
                fold_bucket(bucket, self._sync_enabled)
            self._launch(bucket)

    def finish_grad_sync(self) -> None:
        """Wait for every bucket's collective (launching the rest first); with instances,
        all-reduce each reduced shard across them; sum ``sequence_parallel`` grads over TP;
        publish param.grad."""
        self.start_grad_sync()
        inter: List[Handle] = []
        for bucket in self.buckets:
            if bucket.handle is not None:
                # Wait before anything reads the shard: the inter-instance all-reduce below, the TP
                # sum and the optimizer would otherwise see a half-reduced buffer.
                bucket.handle.wait()
                bucket.handle = None
            group = bucket.reduce_group
            if group.inter_comm is not None:  # this shard is reduced within the instance now
                lo, hi = self._shard_range(bucket)
                inter.append(group.inter_comm.all_reduce(bucket.grad_data[lo:hi], group.op, async_op=True))
            bucket.launched = False
            bucket.folded = False
        for handle in inter:
            handle.wait()
        self._next_launch = {False: 0, True: 0}
        self._gather.clear_reads()
        # After every dp collective has finished: the TP sum must not write buffers a dp
        # collective is still reducing.
        self._allreduce_sequence_parallel_grads()
        if self.ddp_config.check_for_nan_in_grad and self.buckets:
            # Last: a rank may only raise once all its collectives of the step are done, else its
            # peers stay blocked in one it never joins.
            self._agree_on_nan()
        if self.ddp_config.use_distributed_optimizer:
            # Only this rank's shard of each bucket is reduced: do not show param.grad (the
            # views come back with zero_grad_buffer()). Without it, param.grad is the reduced
            # main_grad view when the dtypes match; with fp32 grads of bf16 params it stays
            # None (a bf16 copy would cost 2 bytes/param and round): read param.main_grad.
            for p in self.param_names:
                p.grad = None

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients into the buffers without communicating (micro-batches)."""
        prev, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = prev

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every grad buffer (hence ``main_grad`` and a published ``param.grad``)."""
        ext.scale_(self._buffers_table, scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero the grad buffers (param.grad: the zeroed view, or None); call before each
        step's first micro-batch."""
        for bucket in self.buckets:  # a collective still in flight would write after the zeroing
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle, bucket.launched, bucket.folded = None, False, False
            bucket.ready.clear()
        self._next_launch = {False: 0, True: 0}
        self._nan_flags = []
        self._gather.clear_reads()
        # Per bucket (they tile each buffer): zeroed now, or, where the last complete backward
        # produced every gradient through autograd, by the first gradient of each parameter
        # (a copy instead of zero-fill + add: Bucket.zero_or_defer). param.grad is the zeroed
        # view, or None where the zeroing is deferred (autograd then hands over its gradient).
        for bucket in self.buckets:
            bucket.zero_or_defer()

    def broadcast_params(self) -> None:
        """Copy data-parallel rank 0's parameters to every rank (call once after init/load);
        expert parameters from expert-data-parallel rank 0 (each EP rank holds its own experts)."""
        expert_group = self.parallel.expert_dp.group if self.parallel is not None else self.process_group
        for p in self.module.parameters():
            group = expert_group if is_expert_param(p) else self.process_group
            if group is not None and dist.get_world_size(group) > 1:
                # dist.broadcast's src is a global rank, even with a group.
                dist.broadcast(p.data, src=dist.get_global_rank(group, 0), group=group)

    # ------------------------------------------------------------------ param gather
    def start_param_sync(self, *, force_sync: bool = False) -> None:
        """Distributed optimizer: all-gather every bucket's updated shard into the params.

        With ``overlap_param_gather`` (and not ``force_sync``) the gathers are launched
        asynchronously in forward order and each is waited for by the forward pre-hook of
        the first module whose forward may read one of its parameters (param_gather.py).
        """
        if self.ddp_config.use_distributed_optimizer:
            self._gather.start(force_sync=force_sync)

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather; call before reading parameters
        outside a forward (norms, checkpoints)."""
        self._gather.finish()

    # ------------------------------------------------------------------ state
    def state_dict(self, *args, **kwargs):
        """The unwrapped module's state dict (no wrapper prefixes)."""
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load into the wrapped module (copies in place, so buffer views stay valid)."""
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
