"""Checkpoint save and resharding load, measured through the public API (4 gloo ranks, CPU).

    python benchmarks/checkpoint_reshard.py [--layouts tp2dp2,pp2dp2,ep2dp4,fsdp2dp4[,tp2dp2do]]
        [--model small|large] [--repeats 3] [--loads L1,L2] [--json OUT.json] [--dir /tmp/bench_reshard]
    python benchmarks/checkpoint_reshard.py --compare BEFORE.json AFTER.json

Only the public API is timed: ``megadlms.checkpoint.save_checkpoint`` / ``load_checkpoint``
with the run's ``ParallelLayout.of_run``, on models, wrappers and optimizers made by the
trainer's own builders (``parse_config``, ``training.builders``, ``get_optimizer``). The same
script run with ``PYTHONPATH`` pointing at another checkout therefore measures that checkout
("before" / "after"; ``--compare`` prints the ratios of two ``--json`` files).

Models (fp32 params, Adam state, SwiGLU, untied embeddings, vocab 8192): ``small`` GPT 4 layers x
hidden 512 (the issue's prototype measurement), ``large`` 8 layers x hidden 1024. The MoE layouts
(``ep*``) use the same model with 4 experts (top-2) in every layer. Each save layout (``--layouts``)
trains one step, saves, then loads at its own layout and at three others (``LOADS``): TP, PP, EP
resharding and DDP <-> FSDP2 (``tp2dp2do``, not run by default: the distributed
optimizer). The step: each pipeline chunk's output squared and averaged, backward, the
optimizer step (a later chunk gets fixed random hidden states: no schedule needed).

Every load is checked bitwise against the saved state: a SHA-1 of each full logical tensor
(weights and optimizer state, gathered over TP / EP with ``parallel.sharding.gather_full`` and
``full_tensor()`` for FSDP2, independently of the checkpoint code), put together over the pipeline
stages; data-parallel replicas must agree. Time: wall seconds of the slowest rank (barrier
before), median of ``--repeats``. Memory: per rank, the peak resident-set growth during the call
(``/proc/self/status`` VmHWM after minus VmRSS before, the peak reset through
``/proc/self/clear_refs``: covers torch's CPU allocator, which tracemalloc does not see). So that
freed memory kept by malloc cannot hide new allocations, every allocation of 64 KiB or more is its
own mmap (``MALLOC_MMAP_THRESHOLD_``, returned to the system when freed) and ``malloc_trim`` runs
before each call; the table shows the largest rank's value. Bytes written: the checkpoint
directory's size. Files go to ``--dir`` (page cache: reads of files just written).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import hashlib
import json
import os
import shlex
import shutil
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODELS = {
    "small": "--num-layers 4 --hidden-size 512 --num-attention-heads 8",
    "large": "--num-layers 8 --hidden-size 1024 --num-attention-heads 16",
}
COMMON = (
    "--seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 "
    "--train-iters 1 --lr 1e-3 --clip-grad 0 --mock-data --tokenizer-type ByteTokenizer --vocab-size 8192 "
    "--swiglu --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 "
    "--num-workers 0 --seed 7"
)
MOE = "--num-experts 4 --moe-router-topk 2"
LAYOUTS = {  # name -> flags (4 ranks: dp is what tp x pp leaves)
    "tp2dp2": "--tensor-model-parallel-size 2",
    "tp1dp4": "",
    "tp4dp1": "--tensor-model-parallel-size 4",
    "pp2dp2": "--pipeline-model-parallel-size 2",
    "pp4dp1": "--pipeline-model-parallel-size 4",
    "pp2tp2": "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2",
    "ep2dp4": f"{MOE} --expert-model-parallel-size 2",
    "ep1dp4": MOE,
    "ep4dp4": f"{MOE} --expert-model-parallel-size 4",
    "ep2pp2": f"{MOE} --expert-model-parallel-size 2 --pipeline-model-parallel-size 2",
    "fsdp2dp4": "--use-torch-fsdp2",
    "fsdp2tp2": "--use-torch-fsdp2 --tensor-model-parallel-size 2",
    "tp2dp2do": "--tensor-model-parallel-size 2 --use-distributed-optimizer",
    "tp1dp4do": "--use-distributed-optimizer",
}
LOADS = {  # save layout -> the three other layouts it is loaded at (and at itself)
    "tp2dp2": ("tp1dp4", "tp4dp1", "pp2dp2"),
    "pp2dp2": ("tp1dp4", "pp4dp1", "pp2tp2"),
    "ep2dp4": ("ep1dp4", "ep4dp4", "ep2pp2"),
    "fsdp2dp4": ("tp1dp4", "tp2dp2", "fsdp2tp2"),
    # not in the list (--layouts tp2dp2do): the distributed optimizer's shards
    "tp2dp2do": ("tp1dp4do", "tp1dp4", "tp4dp1"),
}
DEFAULT = ("tp2dp2", "pp2dp2", "ep2dp4", "fsdp2dp4")  # the save layouts


# ----------------------------------------------------------------------------- the run
class Run:
    """One layout's model, wrapper, optimizer and checkpoint layout, made as the trainer makes them."""

    def __init__(self, model: str, layout: str, seed: int, groups: dict) -> None:
        from megadlms.checkpoint import ParallelLayout
        from megadlms.config import parse_config
        from megadlms.optimizer import get_optimizer
        from megadlms.training import builders, pipeline_run

        argv = shlex.split(f"{MODELS[model]} {COMMON} {LAYOUTS[layout]} --seed {seed}")
        config = parse_config(argv, world_size=dist.get_world_size())
        config = config.with_tokenizer(config.data.tokenizer.build())
        device = torch.device("cpu")
        # process groups once per layout (``groups``: the cache), as a run builds them once
        if layout not in groups:
            groups[layout] = builders.build_parallel(config, device, seed)
        self.groups, self.tp = groups[layout]
        grad_groups = self.groups.for_gradients()
        kw = dict(seed=seed, device=device, core_attn_implementation="TEDotProductAttention", tp=self.tp)
        pp = self.groups.pp
        built = (
            builders.build_model(config.model, **kw)
            if pp.size == 1
            else pipeline_run.build_chunks(config, pp.rank, **kw)
        )
        self.modules = built if isinstance(built, list) else [built]
        self.wrapper = builders.wrap_model(built, config, grad_groups)
        self.optimizer = get_optimizer(config.optimizer, self.wrapper)
        self.layout = ParallelLayout.of_run(grad_groups, self.tp)
        self.hidden, self.vocab = config.model.hidden_size, config.model.vocab_size

    def train_step(self) -> None:
        """One step that fills the Adam state: every chunk's output squared and averaged."""
        chunks = getattr(self.wrapper, "chunks", [self.wrapper])
        g = torch.Generator().manual_seed(11 + self.groups.dp.rank)
        ids = torch.randint(0, self.vocab, (2, 64), generator=g)
        self.optimizer.zero_grad()
        for chunk, module in zip(chunks, self.modules):
            if module.pipeline.pre_process:
                out = chunk(input_ids=ids)
            else:
                out = chunk(hidden_states=torch.randn(2, 64, self.hidden, generator=g))
            out.float().square().mean().backward()
        self.wrapper.finish_grad_sync()
        ok, _ = self.optimizer.step()
        assert ok, "the benchmark's training step was skipped"


def _digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()


def _full(t: torch.Tensor, like: torch.Tensor, run: Run) -> torch.Tensor:
    """The full logical tensor of ``t`` (sharded like parameter ``like``; collective)."""
    from megadlms.parallel.sharding import expert_shard_dim, gather_full, shard_spec

    if hasattr(t, "full_tensor"):  # FSDP2: over dp; under tp > 1 still this TP rank's shard
        t = t.full_tensor()
    if t.dim() == 0:
        return t
    spec = shard_spec(like)
    if spec is not None and run.groups.tp.size > 1:
        return gather_full(t, run.groups.tp.group, *spec)
    dim = expert_shard_dim(like)
    if dim is not None and run.groups.ep.size > 1:
        return gather_full(t, run.groups.ep.group, dim)
    return t


def state_digests(run: Run) -> dict:
    """{key: digest} of every full weight and optimizer tensor of the whole model (collective)."""
    params = {n: p for m in run.modules for n, p in m.named_parameters()}
    items = [(f"model/{n}", p, p) for n, p in params.items()]
    for fqn, st in run.optimizer.state_dict()["state"].items():
        items += [(f"optimizer/{fqn}/{k}", v, params[fqn]) for k, v in st.items() if torch.is_tensor(v)]
    mine = {key: _digest(_full(t, like, run)) for key, t, like in sorted(items, key=lambda x: x[0])}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    merged: dict = {}
    for d in everyone:
        for k, v in d.items():
            if merged.setdefault(k, v) != v:
                merged[k] = "replicas differ"
    return merged


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


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _save(run: Run, root: str) -> None:
    from megadlms.checkpoint import save_checkpoint

    save_checkpoint(root, 1, model=run.wrapper, optimizer=run.optimizer, save_rng=False, layout=run.layout)


def _load(run: Run, path: str) -> None:
    from megadlms.checkpoint import load_checkpoint

    load_checkpoint(path, model=run.wrapper, optimizer=run.optimizer, load_rng=False, layout=run.layout)


def _bench_layout(a, save_at: str, res: dict, groups: dict) -> None:
    """``--repeats`` saves at ``save_at`` and loads at it and at its LOADS, each load checked."""
    root = os.path.join(a.dir, save_at)
    trained = Run(a.model, save_at, seed=1, groups=groups)
    trained.train_step()
    saved = state_digests(trained)
    path = os.path.join(root, "iter_0000001")
    for _ in range(a.repeats):
        if dist.get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
        res.setdefault(f"{save_at} save", []).append(_measure(functools.partial(_save, trained, root)))
    res[f"{save_at} bytes"] = _dir_bytes(path)
    del trained
    for target in (save_at,) + (LOADS[save_at] if a.loads is None else a.loads):
        for _ in range(a.repeats):
            run = Run(a.model, target, seed=3, groups=groups)  # other weights until loaded
            res.setdefault(f"{save_at} load {target}", []).append(
                _measure(functools.partial(_load, run, path))
            )
            loaded = state_digests(run)
            bad = sorted(k for k in saved.keys() | loaded.keys() if saved.get(k) != loaded.get(k))
            if bad:
                raise RuntimeError(f"load of the {save_at} checkpoint at {target}: differs at {bad[:3]}")
            del run


def _worker(rank: int, world: int, a) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    start_load = os.getloadavg()
    res: dict = {}
    groups: dict = {}
    for save_at in a.layouts.split(","):
        _bench_layout(a, save_at, res, groups)
    if rank == 0:
        import megadlms

        out = {
            "model": a.model,
            "repeats": a.repeats,
            "megadlms": os.path.dirname(megadlms.__file__),
            "loadavg": os.getloadavg(),  # at the end; and at the start:
            "loadavg_start": start_load,
            "results": {k: v if isinstance(v, int) else _summary(v) for k, v in res.items()},
        }
        _print_table(out)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def _summary(samples: list) -> dict:
    return {
        "s": statistics.median(x[0] for x in samples),
        "mb": statistics.median(x[1] for x in samples),
        "samples": samples,
    }


# -------------------------------------------------------------------------- tables
def _print_table(out: dict) -> None:
    res = out["results"]
    print(
        f"model {out['model']} ({MODELS[out['model']]}), median of {out['repeats']}, 4 gloo ranks, "
        f"every load bitwise; megadlms from {out['megadlms']}; load average {out.get('loadavg_start')} "
        f"at the start, {out['loadavg']} at the end"
    )
    print("| operation | s (slowest rank) | peak extra MB/rank | bytes written |")
    print("|---|---|---|---|")
    for k, v in res.items():
        if isinstance(v, dict):
            written = res.get(k.replace(" save", " bytes"), "") if k.endswith(" save") else ""
            print(f"| {k} | {v['s']:.3f} | {v['mb']:.0f} | {written} |")


def compare(before_path: str, after_path: str) -> None:
    """The ratios of two ``--json`` results: before / after time and memory (> 1: after is better)."""
    with open(before_path) as f:
        before = json.load(f)
    with open(after_path) as f:
        after = json.load(f)
    print(f"model {after['model']}: before {before['megadlms']} (load {before['loadavg']}), ", end="")
    print(f"after {after['megadlms']} (load {after['loadavg']})")
    print("| operation | before s | after s | speed-up | before MB | after MB | memory ratio |")
    print("|---|---|---|---|---|---|---|")
    for k, b in before["results"].items():
        x = after["results"].get(k)
        if x is None:
            continue
        if isinstance(b, int):
            print(f"| {k} | | | | {b / 2**20:.1f} MiB | {x / 2**20:.1f} MiB | {b / max(x, 1):.2f} |")
            continue
        sp, mr = b["s"] / max(x["s"], 1e-9), b["mb"] / max(x["mb"], 1e-9)
        print(
            f"| {k} | {b['s']:.3f} | {x['s']:.3f} | {sp:.2f}x | {b['mb']:.0f} | {x['mb']:.0f} | {mr:.2f}x |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--layouts", default=",".join(DEFAULT), help=f"save layouts, comma-separated: {', '.join(LOADS)}"
    )
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="write the results here (for --compare)")
    p.add_argument(
        "--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="print the ratios of two --json files"
    )
    p.add_argument(
        "--loads", help="load at these layouts (comma-separated) besides the save layout, instead of LOADS"
    )
    p.add_argument("--port", type=int, default=29850)
    p.add_argument("--dir", default="/tmp/bench_reshard")
    a = p.parse_args()
    if a.compare:
        compare(*a.compare)
        return
    unknown = [x for x in a.layouts.split(",") if x not in LOADS]
    if unknown:
        p.error(f"--layouts {','.join(unknown)}: choose among {', '.join(LOADS)}")
    if a.loads is not None:  # one tuple from here on
        a.loads = tuple(x for x in a.loads.split(",") if x)
    unknown = [x for x in a.loads or () if x not in LAYOUTS]
    if unknown:
        p.error(f"--loads {','.join(unknown)}: choose among {', '.join(LAYOUTS)}")
    shutil.rmtree(a.dir, ignore_errors=True)
    # read by glibc when each spawned rank starts: large tensors are mmapped, freed at once
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    mp.spawn(_worker, args=(4, a), nprocs=4, join=True)
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
