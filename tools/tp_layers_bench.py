"""Forward+backward time of one tensor-parallel MLP: megadlms' TP layers vs torch DTensor TP.

    torchrun --nproc_per_node 2 tools/tp_layers_bench.py [--hidden 512] [--reps 20]

The same [batch, seq, hidden] -> 4*hidden -> hidden GELU MLP, split column- then row-wise over
the 2 ranks: (a) ``megadlms.parallel`` ColumnParallelLinear / RowParallelLinear (plain local
tensors, the layers FSDP2 wraps under --use-torch-fsdp2 --tensor-model-parallel-size),
(b) ``nn.Linear`` parallelized with torch's ColwiseParallel / RowwiseParallel (DTensor
parameters, torchtitan's way). The two alternate rep by rep so machine load hits both alike;
rank 0 prints the median seconds of each and their ratio, and the largest output difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(here, "python"), here]


def main() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from megadlms.parallel.layers import ColumnParallelLinear, RowParallelLinear

    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,))
    h, group = a.hidden, dist.group.WORLD

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(h, 4 * h), torch.nn.GELU(), torch.nn.Linear(4 * h, h))
    ours = torch.nn.Sequential(
        ColumnParallelLinear(h, 4 * h, tp_group=group),
        torch.nn.GELU(),
        RowParallelLinear(4 * h, h, tp_group=group),
    )
    with torch.no_grad():  # the same weights in both: ours holds this rank's slices
        r = dist.get_rank()
        ours[0].weight.copy_(ref[0].weight.chunk(tp, 0)[r])
        ours[0].bias.copy_(ref[0].bias.chunk(tp, 0)[r])
        ours[2].weight.copy_(ref[2].weight.chunk(tp, 1)[r])
        ours[2].bias.copy_(ref[2].bias)
    dtp = parallelize_module(ref, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    x = torch.randn(a.batch, a.seq, h, generator=torch.Generator().manual_seed(1))

    def step(model):
        t0 = time.perf_counter()
        y = model(x)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        y.square().mean().backward()
        return time.perf_counter() - t0, y.detach()

    t_ours, t_dt = [], []
    for i in range(a.reps + 2):
        for model, sink in ((ours, t_ours), (dtp, t_dt)):
            dt, y = step(model)
            if i >= 2:  # warm-up left out
                sink.append(dt)
            model.zero_grad(set_to_none=True)
            if model is ours:
                y_ours = y
            else:
                diff = (y - y_ours).abs().max().item()
    if dist.get_rank() == 0:
        m_ours, m_dt = statistics.median(t_ours), statistics.median(t_dt)
        print(
            json.dumps(
                {"ours_s": m_ours, "dtensor_s": m_dt, "dtensor_over_ours": m_dt / m_ours, "max_diff": diff}
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
