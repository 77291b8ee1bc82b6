"""Per-rank model and optimizer state, and step time, of one training run (any layout).

    torchrun --nproc_per_node 4 tools/state_per_rank.py [pretrain_difflm.py flags]

Runs ``megadlms.pretrain.run`` with the flags, then prints one JSON line (rank 0): the bytes of
this rank's LOCAL parameter pieces (FSDP2: the DTensor shards), of its optimizer state
(Adam's exp_avg / exp_avg_sq; fp32 main copies with --bf16), the largest of each over the
ranks, and the median wall time of a training step (the first two steps left out: warm-up).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(here, "python"), here]


def _local_bytes(tensors) -> int:
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local if t.dim() > 0)


def main(argv) -> None:
    import torch
    import torch.distributed as dist

    from megadlms.distributed import unwrap_model
    from megadlms.pretrain import run
    from megadlms.training import train

    real, seen, times = train.train_step, {}, []

    def timed(model, optimizer, *a, **k):
        seen["model"], seen["optimizer"] = model, optimizer
        t0 = time.perf_counter()
        out = real(model, optimizer, *a, **k)
        times.append(time.perf_counter() - t0)
        return out

    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        # Ours, so the group outlives run() for the max over ranks below.
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    train.train_step = timed
    try:
        res = run(argv)
    finally:
        train.train_step = real
    params = _local_bytes(unwrap_model(seen["model"]).parameters())
    states = [t for st in seen["optimizer"].inner.state.values() for t in st.values()]
    states += [e.main for e in seen["optimizer"].layout.entries if getattr(e, "owns_main", False)]
    mine = torch.tensor([float(params), float(_local_bytes(states))], dtype=torch.float64)
    most = mine.clone()
    if dist.is_initialized():
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "wrapper": res.wrapper,
                    "params_bytes_rank0": int(mine[0]),
                    "optimizer_bytes_rank0": int(mine[1]),
                    "params_bytes_max": int(most[0]),
                    "optimizer_bytes_max": int(most[1]),
                    "step_s_median": statistics.median(times[2:]) if len(times) > 2 else None,
                    "final_loss": res.losses[max(res.losses)],
                }
            )
        )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
