"""What a rank's run actually allocates, measured the way python/megadlms/planning/memory.py
counts it (its module docstring): run inside the test pool's worlds."""

from __future__ import annotations

import torch

from megadlms.common.dtensor import local_tensor
from megadlms.config import parse_config
from megadlms.data import ByteTokenizer
from megadlms.optimizer import get_optimizer
from megadlms.planning.memory import state_bytes
from megadlms.training import builders, pipeline_run

CPU = torch.device("cpu")
STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param", "momentum_buffer")


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        s = local_tensor(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _forward_backward(model, config, chunks) -> None:
    """One forward + backward (FSDP2: its reduce-scatter allocates the sharded gradients)."""
    ids = torch.randint(0, 200, (1, config.model.seq_length))
    model(ids).float().sum().backward()
    model.finish_grad_sync()


def measure(config, groups, tp):
    """(weights, grads, optimizer) bytes this rank allocates for ``config``'s layout."""
    pp = groups.pp
    kw = dict(seed=1, device=CPU, core_attn_implementation="TEDotProductAttention", tp=tp)
    chunks = pipeline_run.build_chunks(config, pp.rank, **kw)
    model = builders.wrap_model(chunks if pp.size > 1 else chunks[0], config, groups.for_gradients())
    opt = get_optimizer(config.optimizer, model)
    params = [p for c in chunks for p in c.parameters()]
    if config.parallel.use_torch_fsdp2:
        _forward_backward(model, config, chunks)
        grads = _storage_bytes([p.grad for p in params if p.grad is not None])
    else:
        grads = _storage_bytes([b.grad_data for w in model.chunks for b in w.buffers_])
    opt.step()  # creates the optimizer state (DDP: from the zero grad buffers)
    weights = _storage_bytes(params)
    owned = [e.main for e in opt.layout.entries if e.owns_main]
    state = [v for st in opt.inner.state.values() for k, v in st.items() if k in STATE_KEYS]
    optimizer = sum(t.numel() * t.element_size() for t in owned) + sum(
        local_tensor(t).numel() * local_tensor(t).element_size() for t in state
    )
    return weights, grads, optimizer


def measure_and_plan(rank, world, argvs):
    """For each argv: (measured, planned) (weights, grads, optimizer) bytes of this rank."""
    out = []
    for argv in argvs:
        config = parse_config(argv, world_size=world).with_tokenizer(ByteTokenizer())
        groups, tp = builders.build_parallel(config, CPU, 1)
        got = measure(config, groups, tp)
        gg = groups.for_gradients()  # the axes the wrappers reduce and shard over
        expert = gg.expert_dp.rank if gg.ep.size > 1 else gg.dp_intra.rank
        plan = state_bytes(config, pp_rank=gg.pp.rank, shard_rank=gg.dp_intra.rank, expert_shard_rank=expert)
        out.append((got, (plan.weights, plan.grads, plan.optimizer)))
    return out
