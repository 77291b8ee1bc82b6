"""Sharded checkpoints: today's hand gathers vs DTensor views resharded by DCP (4 gloo ranks, CPU).

    python benchmarks/checkpoint_reshard.py [--repeats 3] [--layers 4] [--hidden 512] [--port 29850]

A GPTModel (SwiGLU, untied embeddings, ``--layers`` x ``--hidden``) is trained one step at
tp2 x dp2 under our DistributedDataParallel + MixedPrecisionOptimizer (Adam state), then its
weights and optimizer state are saved and loaded back at tp2 x dp2, tp1 x dp4 and tp4 x dp1 by

* baseline: ``megadlms.checkpoint.save_checkpoint`` / ``load_checkpoint`` (TP shards gathered to full
  tensors by hand over the TP group, written by DCP; cut to shards again on load:
  checkpoint/tensor_parallel.py, checkpoint/pipeline.py, parallel/sharding.py);
* prototype: every tensor wrapped as a ``DTensor.from_local`` view on the run's [pp, dp, tp]
  DeviceMesh (``Shard(tp_dim)`` over tp, ``Replicate()`` elsewhere; SwiGLU's two blocks as a
  [2, F/tp, H] view sharded on dim 1 so the global tensor is layout independent), saved and
  loaded by ``dcp.save`` / ``dcp.load``, which reshard themselves. Both paths write the same
  size/CRC manifest and common.json (``finalize_checkpoint``) and verify it before loading; RNG
  files are off in both, so the difference is the tensor path alone.

Every load is checked bitwise against the saved full state (gathered independently with
``sharding.gather_full``). Time: wall seconds of the slowest rank (barrier before), median of
``--repeats``. Memory: per rank, the peak resident-set growth during the call (Linux
``/proc/self/status`` VmHWM after minus VmRSS before, with the peak reset through
``/proc/self/clear_refs``: covers torch's CPU allocator, which tracemalloc does not see). So
that freed memory kept by malloc cannot hide new allocations, every allocation of 64 KiB or more
is its own mmap (``MALLOC_MMAP_THRESHOLD_``, returned to the system when freed) and
``malloc_trim`` runs before each call; the table shows the largest rank's value. Files go to
``--dir`` (page cache: reads of files just written).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from megadlms.checkpoint import (
    ParallelLayout,
    checkpoint_dir,
    load_checkpoint,
    read_common,
    save_checkpoint,
    verify_checkpoint,
)
from megadlms.checkpoint.commit import finalize_checkpoint

LAYOUTS = {"tp2dp2": 2, "tp1dp4": 1, "tp4dp1": 4}  # name -> tp (dp = 4 / tp)
SAVE_AT = "tp2dp2"


# ----------------------------------------------------------------------------- model
def _build(cfg, groups, seed: int):
    """(module, ddp wrapper, optimizer) at ``groups``' layout after one training step."""
    from megadlms.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megadlms.models import GPTModel
    from megadlms.optimizer import OptimizerConfig, get_optimizer
    from megadlms.parallel import TensorParallelContext

    torch.manual_seed(seed)  # full tensors drawn alike at every tp: the init is layout independent
    module = GPTModel(cfg, tp=TensorParallelContext(group=groups.tp.group))
    wrapper = DistributedDataParallel(module, DistributedDataParallelConfig(), process_group=groups.dp.group)
    opt = get_optimizer(OptimizerConfig(lr=1e-3, clip_grad=0.0), wrapper)
    g = torch.Generator().manual_seed(seed + groups.dp.rank)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    wrapper(ids).float().square().mean().backward()
    wrapper.finish_grad_sync()
    opt.step()
    return module, wrapper, opt


def _full_state(module, opt, groups) -> dict:
    """Every weight and optimizer tensor as its full logical tensor (collective; the reference)."""
    from megadlms.parallel.sharding import gather_full, shard_spec

    params = dict(module.named_parameters())
    flat = {f"model/{n}": (p, p) for n, p in params.items()}
    for fqn, st in opt.state_dict()["state"].items():
        flat.update(
            {f"optimizer/state/{fqn}/{k}": (v, params[fqn]) for k, v in st.items() if torch.is_tensor(v)}
        )
    out = {}
    for key in sorted(flat):
        t, like = flat[key]
        spec = shard_spec(like)
        full = gather_full(t.detach(), groups.tp.group, *spec) if spec and t.dim() > 0 else t.detach()
        out[key] = full.clone()
    return out


# ------------------------------------------------------------------------ prototype
def _view(t: torch.Tensor, like: torch.Tensor, groups):
    """``t`` (a local tensor sharded like parameter ``like``) as a DTensor over the run's mesh,
    sharing its storage (DCP then writes / fills it in place)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from megadlms.parallel.sharding import sharding_of

    sharding = sharding_of(like)
    placements = [Replicate(), Replicate(), Replicate()]  # mesh dims [pp, dp, tp]
    if sharding.tp_dim is not None and t.dim() > 0:
        dim = sharding.tp_dim
        if sharding.tp_blocks > 1:
            # rank r holds chunk r of every block: a [blocks, n/tp, ...] view sharded on the
            # chunk dim is exactly that, and its global shape is the same at every tp.
            shape = list(t.shape)
            t = t.view(
                shape[:dim] + [sharding.tp_blocks, shape[dim] // sharding.tp_blocks] + shape[dim + 1 :]
            )
            dim += 1
        placements[2] = Shard(dim)
    return DTensor.from_local(t, groups.mesh, placements, run_check=False)


def _dtensor_state(module, opt, groups) -> tuple:
    """(flat DTensor-view state dict, the optimizer state dict it views)."""
    params = dict(module.named_parameters())
    sd = {f"model/{n}": _view(p.data, p, groups) for n, p in params.items()}
    opt_sd = opt.state_dict()
    for fqn, st in opt_sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                sd[f"optimizer/state/{fqn}/{k}"] = _view(v, params[fqn], groups) if v.dim() > 0 else v
    return sd, opt_sd


def _proto_save(root: str, module, wrapper, opt, groups) -> str:
    final = checkpoint_dir(root, 1)
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.makedirs(final + ".tmp")
    dist.barrier()
    sd, _ = _dtensor_state(module, opt, groups)
    dcp.save(sd, checkpoint_id=final + ".tmp")
    dist.barrier()
    if dist.get_rank() == 0:  # the same manifest + common.json + rename as the baseline
        finalize_checkpoint(root, 1, {"iteration": 1, "ckpt_format": "torch_dist"})
    dist.barrier()
    return final


def _proto_load(path: str, module, wrapper, opt, groups) -> None:
    verify_checkpoint(path, read_common(path))
    sd, opt_sd = _dtensor_state(module, opt, groups)
    dcp.load(sd, checkpoint_id=path)  # fills the views: the parameters and the state tensors
    for fqn, st in opt_sd["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v) and v.dim() == 0:
                st[k] = sd[f"optimizer/state/{fqn}/{k}"]
    opt.load_state_dict(opt_sd)


def _old_format_keys(path: str, cfg, groups, saved: dict) -> tuple:
    """Load a checkpoint of today's format (the baseline's) through DTensor views: (keys read
    bitwise, two-block keys skipped). Their stored shape is [2F, H], the view's global one
    [2, F, H], which DCP refuses: those need a reshape on the way (or a format change)."""
    from torch.distributed.tensor import DTensor

    from megadlms.parallel.sharding import sharding_of

    module, _, opt = _build(cfg, groups, seed=7)
    params = dict(module.named_parameters())
    sd, _ = _dtensor_state(module, opt, groups)
    blocks = {k for k in sd if sharding_of(params[k.split("/")[-2 if "/state/" in k else -1]]).tp_blocks > 1}
    direct = {k: v for k, v in sd.items() if k not in blocks and v.dim() > 0}
    dcp.load(direct, checkpoint_id=path)
    same = [
        k
        for k, v in direct.items()
        if torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, saved[k].view(v.shape))
    ]
    return len(same), len(direct), len(blocks)


# ------------------------------------------------------------------------- baseline
def _base_save(root: str, module, wrapper, opt, groups) -> str:
    return save_checkpoint(
        root, 1, model=wrapper, optimizer=opt, layout=ParallelLayout(tp_group=groups.tp.group), save_rng=False
    )


def _base_load(path: str, module, wrapper, opt, groups) -> None:
    load_checkpoint(
        path, model=wrapper, optimizer=opt, layout=ParallelLayout(tp_group=groups.tp.group), load_rng=False
    )


PATHS = {"baseline": (_base_save, _base_load), "dtensor": (_proto_save, _proto_load)}
"""(save, load) of each path, all called as (dir, module, wrapper, optimizer, groups)."""


# -------------------------------------------------------------------------- measure
def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _measure(fn) -> tuple:
    """(seconds of the slowest rank, largest per-rank peak RSS growth in MB) of ``fn()``."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed small-chunk memory back first
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _rss_kb("VmRSS")
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    peak_mb = (_rss_kb("VmHWM") - before) / 1024
    t = torch.tensor([took, peak_mb], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0]), float(t[1])


def _same(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _round(kind: str, cfg, layouts: dict, trained: tuple, saved: dict, root: str, res: dict) -> None:
    """One save at SAVE_AT and one load per layout with ``kind``'s path; each load checked."""
    save, load = PATHS[kind]
    module, wrapper, opt = trained
    res.setdefault((kind, "save"), []).append(
        _measure(functools.partial(save, root, module, wrapper, opt, layouts[SAVE_AT]))
    )
    path = os.path.join(root, "iter_0000001")
    for name, groups in layouts.items():
        target = _build(cfg, groups, seed=7)  # different weights until loaded
        res.setdefault((kind, f"load {name}"), []).append(
            _measure(functools.partial(load, path, *target, groups))
        )
        ok = torch.tensor([float(_same(_full_state(target[0], target[2], groups), saved))])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank raises together
        if not ok.item():
            raise RuntimeError(f"{kind} load at {name}: the loaded state differs from the saved one")
        del target


def _worker(rank: int, world: int, a) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megadlms.models import TransformerConfig
    from megadlms.parallel import ParallelGroups

    cfg = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=8, vocab_size=8192, seq_length=64,
        swiglu=True, untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    layouts = {name: ParallelGroups.build(tp=tp) for name, tp in LAYOUTS.items()}
    trained = _build(cfg, layouts[SAVE_AT], seed=1)
    saved = _full_state(trained[0], trained[2], layouts[SAVE_AT])
    res = {}
    for r in range(a.repeats):
        for kind in PATHS if r % 2 == 0 else reversed(PATHS):  # alternate who goes first
            _round(kind, cfg, layouts, trained, saved, os.path.join(a.dir, kind), res)
    old = _old_format_keys(os.path.join(a.dir, "baseline", "iter_0000001"), cfg, layouts["tp1dp4"], saved)
    if rank == 0:
        _report(res, saved, a)
        print(
            f"today's format read through DTensor views at tp1dp4: {old[0]}/{old[1]} keys bitwise; "
            f"{old[2]} two-block (SwiGLU fc1) keys need a [2F, H] -> [2, F, H] reshape"
        )
    dist.barrier()
    dist.destroy_process_group()


def _report(res: dict, saved: dict, a) -> None:
    mb = sum(t.numel() * t.element_size() for t in saved.values()) / 2**20
    print(
        f"GPT {a.layers} layers x hidden {a.hidden} (SwiGLU, vocab 8192, untied): full state {mb:.0f} MiB "
        f"(weights + Adam); saved at {SAVE_AT}; 4 gloo ranks; median of {a.repeats}; every load bitwise"
    )
    print("| operation | baseline s | DTensor+DCP s | ratio | baseline peak MB/rank | DTensor peak MB/rank |")
    print("|---|---|---|---|---|---|")
    for op in ["save"] + [f"load {n}" for n in LAYOUTS]:
        b, d = res[("baseline", op)], res[("dtensor", op)]
        bt, dt = statistics.median(x[0] for x in b), statistics.median(x[0] for x in d)
        bm, dm = statistics.median(x[1] for x in b), statistics.median(x[1] for x in d)
        print(f"| {op} | {bt:.3f} | {dt:.3f} | {dt / bt:.2f} | {bm:.0f} | {dm:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--port", type=int, default=29850)
    p.add_argument("--dir", default="/tmp/bench_reshard")
    a = p.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    # read by glibc when each spawned rank starts: large tensors are mmapped, freed at once
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    mp.spawn(_worker, args=(4, a), nprocs=4, join=True)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
