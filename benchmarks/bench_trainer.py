"""The real trainer's throughput: ``pretrain_difflm.py`` under torchrun, one row per layout.

    python benchmarks/bench_trainer.py                   # GPU: MegaDLMs' 1.7B model, seq 4096
    python benchmarks/bench_trainer.py --tiny --rows ddp-mbs4,fsdp2-mbs4   # CPU, seconds

Each row is one ``torchrun --nproc-per-node 1 pretrain_difflm.py`` run with mock data and
``--log-throughput`` (data loader, diffusion noise and loss, optimizer, logging: everything a
user runs), ``--iters`` iterations; the figures are medians over the iterations after the first
(warm-up), read from its ``--metrics-jsonl``: seconds per iteration, Megatron's TFLOP/s per
GPU, MFU against the datasheet's dense bf16 peak (989 for H100/H200; ``--peak-tflops``
overrides), tokens/s, peak memory. A row also records the run's exit status: a run that
trained but did not exit 0 (or printed "terminate called") is a FAIL, and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATASHEET_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}

MODEL_1P7B = (
    "--num-layers 28 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 6144 --swiglu "
    "--seq-length 4096 --max-position-embeddings 4096 --vocab-size 50289 --normalization RMSNorm "
    "--norm-epsilon 1e-6 --disable-bias-linear --position-embedding-type rope --qk-layernorm "
    "--untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 --bf16"
).split()
MODEL_TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 --swiglu "
    "--seq-length 64 --max-position-embeddings 64 --normalization RMSNorm --disable-bias-linear "
    "--position-embedding-type rope --untie-embeddings-and-output-weights --bf16 "
    "--tokenizer-type ByteTokenizer"
).split()
COMMON = "--mock-data --lr 2e-4 --clip-grad 1.0 --eval-iters 0 --log-interval 1 --log-throughput".split()
DDP = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
FSDP2 = ["--use-torch-fsdp2", "--no-gradient-accumulation-fusion"]
# name -> (micro-batch, global batch, flags): the first GPU run's rows and what this round adds
ROWS = {
    "ddp-mbs4": (4, 16, DDP),
    "ddp-mbs2": (2, 8, DDP),
    "fsdp2-mbs4": (4, 16, FSDP2),
    "fsdp2-zero2-mbs4": (4, 16, [*FSDP2, "--torch-fsdp2-no-reshard-after-forward"]),
    "fsdp2-mbs2": (2, 8, FSDP2),
    "ddp-mbs4-recompute": (4, 16, [*DDP, "--recompute-activations"]),
}


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


def run_row(name: str, model: list, iters: int, folder: str, timeout: float) -> dict:
    """One trainer run; its medians (after iteration 1), exit status and output tail."""
    mbs, gbs, flags = ROWS[name]
    jsonl = os.path.join(folder, f"{name}.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "pretrain_difflm.py",
           *model, *COMMON, *flags, "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs),
           "--train-iters", str(iters), "--metrics-jsonl", jsonl]  # fmt: skip
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
    return {"name": name, "mbs": mbs, "gbs": gbs, "rc": rc, "ok": clean, "tail": out[-3000:],
            "s": med("ms_per_iter") / 1e3, "tflops": med("tflops_per_device"),
            "tokens": med("tokens_per_sec"), "mem": mem}  # fmt: skip


def table(results: list, peak: float, what: str) -> list:
    lines = [
        f"## trainer throughput ({what}; medians of iterations 2..N)",
        f"| row | micro-batch | global batch | s/iter | TFLOP/s/GPU | MFU (of {peak:g} TFLOP/s) | tokens/s "
        "| mem GB | exit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mfu = f"{r['tflops'] / peak:.1%}" if peak else "- (no peak known)"
        status = "0" if r["ok"] else f"FAIL ({r['rc']})"
        lines.append(
            f"| {r['name']} | {r['mbs']} | {r['gbs']} | {r['s']:.3f} | {r['tflops']:.1f} | {mfu} | "
            f"{r['tokens'] / 1e3:.1f}k | {r['mem']:.1f} | {status} |"
        )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="ddp-mbs4,fsdp2-mbs4,fsdp2-zero2-mbs4,ddp-mbs2",
                   help="comma list of: " + ", ".join(ROWS))  # fmt: skip
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU (gloo): checks the script")
    p.add_argument("--peak-tflops", type=float, default=None, help="MFU denominator (default: datasheet)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per row")
    p.add_argument("--out", default=None, help="also append the table to this file")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.rows.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        p.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not a.tiny else None
    peak = a.peak_tflops or next((v for k, v in DATASHEET_BF16_TFLOPS.items() if gpu and k in gpu), 0.0)
    with tempfile.TemporaryDirectory() as folder:
        model = MODEL_TINY if a.tiny else [*MODEL_1P7B, *hf_tokenizer(os.path.join(folder, "tokenizer.json"))]
        results = [run_row(n, model, a.iters, folder, a.timeout) for n in names]
    what = "tiny model, cpu" if a.tiny else f"1.7B model, seq 4096, bf16, 1 x {gpu or 'cpu'}"
    lines = table(results, peak, what)
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
