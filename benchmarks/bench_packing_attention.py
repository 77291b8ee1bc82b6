"""Intra-document attention on this machine: SDPA with a boolean block mask vs torch
flex_attention with a BlockMask (forward; SDPA also forward+backward, flex has no CPU
backward). Usage: python benchmarks/bench_packing_attention.py [--seq 512 --batch 4]"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from megadlms.models.transformer import document_attention_mask


def _time(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a.batch, a.heads, a.seq, 64, generator=g) for _ in range(3))
    docs = (torch.arange(a.seq) * a.docs // a.seq).expand(a.batch, a.seq)
    bool_mask = document_attention_mask(docs, False, "TEDotProductAttention")
    block_mask = document_attention_mask(docs, False, "FlexAttention")
    with torch.no_grad():
        sdpa = _time(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), a.reps)
        flex = _time(lambda: flex_attention(q, k, v, block_mask=block_mask), a.reps)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fb = _time(
        lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=bool_mask).sum().backward(), a.reps
    )
    print(
        f"B={a.batch} H={a.heads} S={a.seq} D=64, {a.docs} docs/row, {torch.get_num_threads()} threads: "
        f"SDPA+bool mask fwd {sdpa:.1f} ms | flex_attention fwd {flex:.1f} ms | SDPA fwd+bwd {fb:.1f} ms"
    )


if __name__ == "__main__":
    main()
