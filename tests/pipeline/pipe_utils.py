"""Shared harness of the pipeline tests: one step of a pipelined GPTModel on gloo ranks, and
the same step in one process on the whole model (the reference)."""

from __future__ import annotations

import torch

from megadlms.diffusion import DiffusionConfig, diffusion_loss, forward_process, objective_inputs
from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megadlms.models import GPTModel, TransformerConfig
from megadlms.parallel import ParallelGroups, TensorParallelContext, model_parallel_manual_seed
from megadlms.parallel.layers import allreduce_sequence_parallel_grads
from megadlms.parallel.sharding import gather_full, shard_spec
from megadlms.pipeline import (
    allreduce_embedding_grads,
    build_embedding_group,
    embedding_grad_params,
    forward_backward_pipelining,
    model_chunks,
    stage_layers,
)
from megadlms.pipeline.p2p import PipelineP2P

V, H, S = 42, 32, 12
MASK = V - 1
SEED = 7


def config(**kw) -> TransformerConfig:
    base = dict(
        num_layers=4,
        hidden_size=H,
        num_attention_heads=4,
        vocab_size=V,
        seq_length=S,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    base.update(kw)
    return TransformerConfig(**base)


def micro_batches(total: int, b: int, vary: bool = True):
    """``total`` micro-batches of b rows with (when ``vary``) a different crop each: the
    activation shape changes from micro-batch to micro-batch."""
    g = torch.Generator().manual_seed(123)
    out = []
    for i in range(total):
        L = S - (i % 3) if vary else S
        labels = torch.randint(0, V - 1, (b, L), generator=g)
        loss_mask = (torch.rand(b, L, generator=g) > 0.1).float()
        out.append(
            {
                "labels": labels,
                "loss_mask": loss_mask,
                "position_ids": torch.arange(L).expand(b, L).contiguous(),
                "sample_idx": torch.arange(i * b, (i + 1) * b),
            }
        )
    return out


DIFF = DiffusionConfig(mask_token_id=MASK, objective="megadlms", varilen_prob=0.0)


def prepare(batch, loss: str):
    """(model input ids, position ids, scoring closure inputs) of one micro-batch."""
    if loss == "diffusion":  # MegaDLMs' objective: text[1:L], masked by the counter-based noise
        inputs = objective_inputs(batch, DIFF)
        clean, lm = inputs["clean"], inputs["loss_mask"]
        noisy, masked, p_mask = forward_process(clean, batch["sample_idx"], DIFF, lm)
        return noisy, inputs["position_ids"], (clean, masked, p_mask, lm)
    return batch["labels"], batch["position_ids"], (batch["labels"], batch["loss_mask"])


def loss_sum(model, logits, targets, loss: str):
    if loss == "diffusion":
        clean, masked, p_mask, lm = targets
        return diffusion_loss(logits, clean, masked, p_mask, lm, model.token_cross_entropy)[0]
    labels, lm = targets
    return (model.token_cross_entropy(logits, labels) * lm).sum()


def num_tokens(batches) -> float:
    return float(sum(b["loss_mask"][:, :-1].sum() for b in batches))  # megadlms: L-1 positions


def reference(cfg_kw: dict, total: int, b: int, loss: str, sgd_lr: float = 0.0):
    """One process, the whole model: per-micro-batch losses and every parameter's grad
    (the loss normalised by the global token count, as the trainer does)."""
    torch.manual_seed(SEED)
    model = GPTModel(config(**cfg_kw))
    batches = micro_batches(total, b)
    norm = num_tokens(batches)
    losses = []
    for batch in batches:
        ids, pos, targets = prepare(batch, loss)
        ls = loss_sum(model, model(ids, pos), targets, loss) / norm
        ls.backward()
        losses.append(ls.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    params = {}
    if sgd_lr:
        params = {n: (p - sgd_lr * p.grad).detach() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _full(t, param, tp_group):
    spec = shard_spec(param)
    return t.clone() if spec is None or tp_group is None else gather_full(t, tp_group, *spec)


def _count_no_sync(ddp) -> None:
    """Count the schedule's ``no_sync()`` entries on this DDP chunk (instance attribute)."""
    inner = ddp.no_sync
    ddp.no_sync_calls = 0

    def counted():
        ddp.no_sync_calls += 1
        return inner()

    ddp.no_sync = counted


def _tensor_shape(mine, loss: str, hidden: int, tpc):
    """Each micro-batch's activation shape [b, L, H] from its own model input (what every stage
    computes from the batch; L / tp, rounded up, under sequence parallelism: the model pads)."""

    def shape(i):
        b, L = prepare(mine[i], loss)[0].shape
        return (b, -(-L // tpc.size) if tpc.sequence_parallel else L, hidden)

    return shape


def _count_p2p_batches():
    """Counts this process's p2p batches (a one-element list) by replacing ``PipelineP2P._batch``
    with a counting wrapper; returns (count, the method), the caller puts the method back."""
    count, batch = [0], PipelineP2P._batch

    def counted(self, ops, *ahead):
        count[0] += bool(ops)
        return batch(self, ops, *ahead)

    PipelineP2P._batch = counted  # type: ignore[method-assign]
    return count, batch


def pipeline_step(rank, world, spec: dict):
    """One step on this rank: spec keys pp, vp, tp, dp, m (micro-batches per dp rank), b, loss,
    cfg (TransformerConfig kwargs), ddp (wrap each chunk), split (stage_layers kwargs),
    forward_only, sgd_lr. Returns this rank's losses, full grads and (SGD) params by name."""
    pp, vp, tp, dp = spec["pp"], spec.get("vp", 1), spec.get("tp", 1), spec.get("dp", 1)
    groups = ParallelGroups.build(tp=tp, pp=pp, dp=dp)
    tracker = model_parallel_manual_seed(SEED, groups.tp.rank)
    tpc = TensorParallelContext(
        group=groups.tp.group if tp > 1 else None,
        sequence_parallel=spec.get("sp", False),
        rng_tracker=tracker,
    )
    cfg = config(**spec.get("cfg", {}))
    ranges = stage_layers(cfg.num_layers, pp, vp=vp, **spec.get("split", {}))[groups.pp.rank]
    models = []
    for chunk in model_chunks(ranges, groups.pp.rank, pp, cfg.num_layers):
        torch.manual_seed(SEED)  # the same seed on every stage: chunks are the whole model's tensors
        models.append(GPTModel(cfg, tp=tpc, pipeline=chunk))
    init = {n: _full(p.detach(), p, tpc.group) for m in models for n, p in m.named_parameters()}
    if spec.get("ddp"):
        ddp_cfg = DistributedDataParallelConfig(
            calculate_per_token_loss=True, overlap_grad_reduce=True, bucket_size=500
        )
        runners = [DistributedDataParallel(m, ddp_cfg, process_group=groups.dp.group) for m in models]
        for r in runners:
            _count_no_sync(r)
    else:
        runners = models
    m, b, loss = spec["m"], spec["b"], spec.get("loss", "ce")
    every = micro_batches(m * dp, b)
    mine = every[groups.dp.rank * m : (groups.dp.rank + 1) * m]
    norm = num_tokens(every)

    def forward_step(c, i, x):
        model, batch = models[c], mine[i]
        ids, pos, targets = prepare(batch, loss)
        run = runners[c]
        out = run(ids, pos) if model.pipeline.pre_process else run(position_ids=pos, hidden_states=x)
        if not model.pipeline.post_process:
            return out
        ls = loss_sum(model, out, targets, loss) / norm
        return ls, ls.detach().double()

    timeline = []
    batches, own_batch = _count_p2p_batches()
    try:
        losses = forward_backward_pipelining(
            runners,
            mine,
            forward_step,
            pp_group=groups.pp,
            forward_only=spec.get("forward_only", False),
            timeline=timeline,
            no_sync=(lambda c: runners[c].no_sync()) if spec.get("ddp") else None,
            tensor_shape=_tensor_shape(mine, loss, cfg.hidden_size, tpc)
            if spec.get("known_shapes")
            else None,
        )
    finally:
        PipelineP2P._batch = own_batch  # type: ignore[method-assign]  # the pool's process runs later tests
    out = {
        "losses": losses,
        "timeline": timeline,
        "init": init,
        "dp_rank": groups.dp.rank,
        "pp_rank": groups.pp.rank,
        "no_sync_calls": [getattr(r, "no_sync_calls", None) for r in runners],
        "p2p_batches": batches[0],
    }
    if spec.get("forward_only"):
        out["grads"] = {n: p.grad for mm in models for n, p in mm.named_parameters()}
        return out
    embedding_group = build_embedding_group(groups)
    if spec.get("ddp"):
        for r in runners:
            r.finish_grad_sync()
        allreduce_embedding_grads(runners, embedding_group)
    elif embedding_group is not None:  # plain modules: the tied copies' own .grad, summed
        for p in embedding_grad_params(models):
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
            torch.distributed.all_reduce(p.grad, group=embedding_group)
    if tpc.sequence_parallel and not spec.get("ddp"):
        for mm in models:
            allreduce_sequence_parallel_grads(mm, tpc.group)
    grads, params = {}, {}
    for mm in models:
        for n, p in mm.named_parameters():
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            grads[n] = _full(g, p, tpc.group)
            if spec.get("sgd_lr"):
                with torch.no_grad():
                    p -= spec["sgd_lr"] * g
                params[n] = _full(p.detach(), p, tpc.group)
    out.update(grads=grads, params=params)
    return out
