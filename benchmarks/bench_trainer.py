"""The real trainer's throughput: ``pretrain_difflm.py`` under torchrun, one row per layout.

    python benchmarks/bench_trainer.py                   # GPU: the ~1B DLM, seq 2048 and 4096
    python benchmarks/bench_trainer.py --model 1.7b --rows ddp-s4096,fsdp2-s4096
    python benchmarks/bench_trainer.py --tiny --rows ddp-s2048,fsdp2-s2048   # CPU, seconds

Each row is one ``torchrun --nproc-per-node 1 pretrain_difflm.py`` run with mock data and
``--log-throughput`` (data loader, diffusion noise and loss, optimizer, logging: everything a
user runs), ``--iters`` iterations; the figures are medians over the iterations after the first
(warm-up), read from its ``--metrics-jsonl``: seconds per iteration, tokens/s, Megatron's
TFLOP/s per device, MFU against the bf16 matmul ceiling measured in this run (8192^3 products;
``--peak-tflops`` overrides it) and against the datasheet's dense bf16 peak, peak memory.
Rows: ``{ddp,fsdp2}-s{2048,4096}[-recompute]``: DDP (+ the distributed optimizer, overlapped
reduce) or FSDP2 at world size 1, sequence 2048 (micro-batch 8) or 4096 (micro-batch 4),
global batch two micro-batches, with ``-recompute`` Megatron's selective recomputation
(``--recompute-activations``: core attention), with ``-compile`` ``--use-torch-compile`` (its
medians leave out iteration 1, which holds the compile), with ``-nofusion``
``--no-gradient-accumulation-fusion`` (a compiled layer is one graph, not split at its
linears). Each row names the SDPA backend the model's
attention call takes at that shape (profiled once here, outside the runs: cuDNN, flash,
mem-efficient, math). ``--deadline`` seconds bound all rows together: a row with less than
``--min-row`` seconds left is "not reached" (not a failure). A row also records the run's exit
status: a run that trained but did not exit 0 (or printed "terminate called") is a FAIL, and
the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "python"), ROOT]
DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}

_SHARED = (
    "--swiglu --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --attention-dropout 0.0 "
    "--hidden-dropout 0.0 --bf16"
).split()
# name -> (layers, hidden, heads, ffn, extra flags); seq and vocab come with the row / tokenizer
MODELS = {
    # bench_gpu.py's ~1B DLM: 18 x (4h^2 + 3h*ffn) + 2 * 50304 * h = 1.16B parameters (untied)
    "1b": (18, 2048, 16, 5632, ["--qk-layernorm"]),
    "1.7b": (28, 2048, 16, 6144, ["--qk-layernorm"]),  # MegaDLMs' 1.7B (the first GPU run's)
    "tiny": (2, 64, 4, 128, ["--tokenizer-type", "ByteTokenizer"]),
}
COMMON = "--mock-data --lr 2e-4 --clip-grad 1.0 --eval-iters 0 --log-interval 1 --log-throughput".split()
DDP = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
FSDP2 = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
RECOMPUTE = ["--recompute-activations"]
# name -> (seq, micro-batch, global batch, flags); the tiny model runs every row at seq 64
ROWS = {
    f"{name}-s{seq}{suffix}": (seq, mbs, 2 * mbs, [*flags, *extra])
    for seq, mbs in ((2048, 8), (4096, 4))
    for name, flags in (("ddp", DDP), ("fsdp2", FSDP2))
    for suffix, extra in (("", []), ("-recompute", RECOMPUTE))
}
for _n in ("ddp-s4096", "fsdp2-s4096", "ddp-s2048"):
    ROWS[f"{_n}-compile"] = (*ROWS[_n][:3], [*ROWS[_n][3], "--use-torch-compile"])
# DDP's default gradient-accumulation fusion splits each compiled layer at its linears (they run
# eagerly: parallel/linear_impl.py); without it the whole layer is one graph.
for _n in ("ddp-s2048", "ddp-s2048-compile"):
    ROWS[f"{_n}-nofusion"] = (*ROWS[_n][:3], [*ROWS[_n][3], "--no-gradient-accumulation-fusion"])
ROWS["fsdp2-zero2-s4096"] = (4096, 4, 8, [*FSDP2, "--torch-fsdp2-no-reshard-after-forward"])
DEFAULT_ROWS = (
    "ddp-s4096,fsdp2-s4096,ddp-s2048,fsdp2-s2048,ddp-s4096-recompute,fsdp2-s4096-recompute,ddp-s4096-compile"
)
TINY_SEQ = 64


def model_flags(model: str, seq: int) -> list:
    """The model's flags at sequence ``seq``."""
    layers, hidden, heads, ffn, extra = MODELS[model]
    return [*_SHARED, *extra, "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--ffn-hidden-size", str(ffn),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq)]  # fmt: skip


def hf_tokenizer(path: str) -> list:
    """A 50,280-entry word-level tokenizer (mask id 50277; GPT-NeoX's vocabulary size, so the
    output layer is the 1.7B model's) written to ``path``; the flags that use it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 50277)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|mask|>", "<|endoftext|>", "<|pad|>"])
    tok.save(path)
    return ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", path, "--mask-token", "50277"]


SDPA_OPS = {  # the aten op F.scaled_dot_product_attention dispatched to -> backend name
    "aten::_scaled_dot_product_cudnn_attention": "cuDNN",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "mem-efficient",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_attention_math": "math",
}


def sdpa_backend(device, batch: int, heads: int, seq: int, head_dim: int, dtype) -> str:
    """The backend SDPA picks for the model's bidirectional attention call (no mask, no
    dropout, [B, N, S, D] views of [B, S, N, D] projections, as models/transformer.py calls
    it), read from the profiled aten op of one forward and backward."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.randn(batch, seq, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
               .requires_grad_() for _ in range(3))  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    names = {e.name for e in prof.events()}
    found = [label for op, label in SDPA_OPS.items() if op in names]
    del q, k, v
    return found[0] if found else "unknown"


def run_row(name: str, model: str, tokenizer: list, iters: int, folder: str, timeout: float) -> dict:
    """One trainer run; its medians (after iteration 1), exit status and output tail."""
    seq, mbs, gbs, flags = ROWS[name]
    seq = TINY_SEQ if model == "tiny" else seq
    jsonl = os.path.join(folder, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "pretrain_difflm.py",
           *model_flags(model, seq), *tokenizer, *COMMON, *flags, "--micro-batch-size", str(mbs),
           "--global-batch-size", str(gbs), "--train-iters", str(iters),
           "--metrics-jsonl", jsonl]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{ROOT}/python:{ROOT}", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = "timeout", f"{exc.stdout or ''}{exc.stderr or ''}"
    rows = []
    if os.path.exists(jsonl):
        with open(jsonl) as f:
            rows = [r for r in map(json.loads, f) if r.get("event") == "train"]
    steady = [r for r in rows if r["iteration"] > 1] or rows

    def med(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    clean = rc == 0 and "terminate called" not in out and len(rows) == iters
    mem = max((r["mem_gb"] for r in rows), default=float("nan"))
    return {"name": name, "seq": seq, "mbs": mbs, "gbs": gbs, "rc": rc, "ok": clean, "tail": out[-3000:],
            "s": med("ms_per_iter") / 1e3, "tflops": med("tflops_per_device"),
            "tokens": med("tokens_per_sec"), "mem": mem}  # fmt: skip


def not_reached(name: str, model: str) -> dict:
    seq, mbs, gbs, _ = ROWS[name]
    return {"name": name, "seq": TINY_SEQ if model == "tiny" else seq, "mbs": mbs, "gbs": gbs, "ok": True,
            "skipped": True}  # fmt: skip


def _pct(x: float, of: float) -> str:
    return f"{x / of:.1%}" if of else "-"


def table(results: list, ceiling: float, datasheet: float, what: str) -> list:
    lines = [
        f"## trainer throughput ({what}; medians of iterations 2..N)",
        f"| row | seq | micro-batch | global batch | SDPA | s/iter | tokens/s | TFLOP/s/device | MFU of "
        f"{ceiling:.3g} (matmul ceiling, measured) | of {datasheet or '-'} (datasheet) | mem GB | exit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        head = f"| {r['name']} | {r['seq']} | {r['mbs']} | {r['gbs']} | {r.get('sdpa', '-')} |"
        if r.get("skipped"):
            lines.append(f"{head} - | - | - | - | - | - | not reached (--deadline) |")
            continue
        status = "0" if r["ok"] else f"FAIL ({r['rc']})"
        lines.append(
            f"{head} {r['s']:.3f} | {r['tokens'] / 1e3:.1f}k | {r['tflops']:.3g} | "
            f"{_pct(r['tflops'], ceiling)} | {_pct(r['tflops'], datasheet)} | {r['mem']:.1f} | {status} |"
        )
    return lines


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default=DEFAULT_ROWS, help="comma list of: " + ", ".join(ROWS))
    p.add_argument("--model", default="1b", choices=sorted(MODELS))
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--tiny", action="store_true", help="--model tiny on CPU (gloo): checks the script")
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator (default: measured)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per row")
    p.add_argument("--deadline", type=float, default=None, help="seconds for all rows (default: none)")
    p.add_argument("--min-row", type=float, default=30.0, help="a row starts only with this much left")
    p.add_argument("--out", default=None, help="also append the table to this file")
    a = p.parse_args(argv)
    a.names = [n.strip() for n in a.rows.split(",") if n.strip()]
    unknown = sorted(set(a.names) - set(ROWS))
    if unknown:
        p.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    if a.iters < 2:
        p.error("--iters must be >= 2 (the first iteration is the warm-up)")
    a.model = "tiny" if a.tiny else a.model
    return a


def probe(model: str, names: list) -> tuple:
    """(device name, measured bf16 matmul ceiling TFLOP/s, {row: SDPA backend}) on this
    process's device; its memory is released before the runs."""
    import torch
    from bench_gpu import matmul_ceiling_tflops

    gpu = torch.cuda.is_available() and model != "tiny"
    device = torch.device("cuda" if gpu else "cpu")
    ceiling = matmul_ceiling_tflops(device, dry=not gpu)
    _, hidden, heads, _, _ = MODELS[model]
    dtype = torch.bfloat16 if gpu else torch.float32
    sdpa = {}
    for n in names:
        seq, mbs = (TINY_SEQ if model == "tiny" else ROWS[n][0]), ROWS[n][1]
        sdpa[n] = sdpa_backend(device, mbs, heads, seq, hidden // heads, dtype)
    if gpu:
        torch.cuda.empty_cache()
    return (torch.cuda.get_device_name() if gpu else "cpu"), ceiling, sdpa


def main(argv=None) -> int:
    a = parse(argv)
    t0 = time.monotonic()
    gpu, ceiling, sdpa = probe(a.model, a.names)
    ceiling = a.peak_tflops or ceiling
    datasheet = next((v for k, v in DATASHEET_BF16_TFLOPS.items() if k in gpu), 0.0)
    results = []
    with tempfile.TemporaryDirectory() as folder:
        tokenizer = [] if a.model == "tiny" else hf_tokenizer(os.path.join(folder, "tokenizer.json"))
        for n in a.names:
            left = float("inf") if a.deadline is None else a.deadline - (time.monotonic() - t0)
            if left < a.min_row:  # too little for a row to start and train
                results.append(not_reached(n, a.model))
            else:
                results.append(run_row(n, a.model, tokenizer, a.iters, folder, min(a.timeout, left)))
            results[-1]["sdpa"] = sdpa[n]
            print(f"{n}: {'not reached' if results[-1].get('skipped') else results[-1]['rc']}", flush=True)
    lines = table(results, ceiling, datasheet, f"{a.model} model, bf16, 1 x {gpu}, torchrun, mock data")
    print("\n".join(lines), flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n".join(lines) + "\n")
    for r in results:
        if not r["ok"]:
            print(f"\n--- {r['name']} did not end cleanly (exit {r['rc']}); its output's tail:", flush=True)
            print(r["tail"], flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
