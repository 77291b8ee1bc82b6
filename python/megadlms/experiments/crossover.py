"""The crossover, reproduced small: an AR model and a DLM trained for many epochs on the same
fixed budget of unique KJV tokens, evaluated on held-out verses.

    python -m megadlms.experiments.crossover [--preset quick|default|tiny] OUTDIR
    bash examples/crossover.sh [--quick] OUTDIR                      # the same

Steps: (1) split the distinct KJV verses (seeded) into held-out rows, held-out cloze verses
and a training budget of ``unique_tokens``, and tokenize the budget with the real
preprocessing CLI; (2) train both models with the real training CLI (``python -m
megadlms.pretrain``), one process each, concurrently, from one flag list that differs only
in ``--model-running-mode`` / ``--attention-mask-type`` (same seed, data order, tokens per
step, LR schedule and optimizer), saving a checkpoint every ``eval_every`` epochs; (3) score
every checkpoint (``crossover_eval``); (4) write OUTDIR/crossover.csv, crossover.png and
summary.md (``crossover_report``). Ni et al., "Diffusion Language Models are Super Data
Learners" (2025) run this at 1-8B parameters and 0.5-96B unique tokens.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import filecmp
import glob
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from . import crossover_data as data
from . import crossover_report as report

MODES = {
    "ar": ["--model-running-mode", "vanilla", "--attention-mask-type", "causal"],
    "dlm": ["--model-running-mode", "difflm-noshift", "--attention-mask-type", "no_mask"],
}


@dataclass(frozen=True, kw_only=True)
class Preset:
    """Sizes of one run (data in tokens, training in epochs over the unique tokens)."""

    unique_tokens: int
    """Training budget: distinct verses are added until this many tokens (bytes + eod)."""
    epochs: int
    """Passes over the unique tokens, for both models."""
    eval_every: int
    """Epochs between checkpoints (each is evaluated)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    global_batch_size: int
    lr: float = 3e-3
    min_lr: float = 2e-4
    heldout_rows: int = 64
    """Held-out (and training-text) rows of seq_length + 1 tokens for the loss metrics."""
    cloze_questions: int = 100
    cloze_choices: int = 4
    answer_len: int = 16
    """Bytes of every cloze choice."""
    nelbo_mc: int = 16
    """Monte Carlo copies per row of the DLM's held-out NELBO."""
    cloze_mc: int = 16
    """Monte Carlo draws per choice of the DLM's likelihood estimate."""
    seed: int = 1234


PRESETS = {
    # the test's: seconds
    "tiny": Preset(
        unique_tokens=2048, epochs=4, eval_every=2, num_layers=2, hidden_size=32, num_attention_heads=4,
        seq_length=32, global_batch_size=8, heldout_rows=8, cloze_questions=8, answer_len=8, nelbo_mc=2,
        cloze_mc=2,
    ),
    # --quick: a few minutes on 2 CPU cores
    "quick": Preset(
        unique_tokens=16384, epochs=32, eval_every=4, num_layers=2, hidden_size=128, num_attention_heads=4,
        seq_length=64, global_batch_size=32, heldout_rows=32, cloze_questions=48, nelbo_mc=8, cloze_mc=8,
    ),
    # docs/crossover.md's plot: 17 minutes on the shared 2-core machine (the AR model overfits by epoch 40)
    "default": Preset(
        unique_tokens=16384, epochs=96, eval_every=8, num_layers=4, hidden_size=128, num_attention_heads=4,
        seq_length=64, global_batch_size=32, cloze_questions=64, nelbo_mc=8, cloze_mc=8,
    ),
}  # fmt: skip


def train_flags(p: Preset, *, data_prefix: str, train_iters: int, save_interval: int) -> List[str]:
    """The flags both models share (model, data, batch, optimizer, LR schedule, seed)."""
    flags = (
        f"--num-layers {p.num_layers} --hidden-size {p.hidden_size} "
        f"--num-attention-heads {p.num_attention_heads} --seq-length {p.seq_length} "
        f"--max-position-embeddings {p.seq_length} --position-embedding-type rope --normalization RMSNorm "
        "--swiglu --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0 "
        f"--micro-batch-size {p.global_batch_size} --global-batch-size {p.global_batch_size} "
        f"--train-iters {train_iters} --lr {p.lr} --min-lr {p.min_lr} --lr-decay-style cosine "
        f"--lr-warmup-iters {max(2, train_iters // 32)} --weight-decay 0.1 --adam-beta1 0.9 "
        f"--adam-beta2 0.95 --clip-grad 1.0 --seed {p.seed} --tokenizer-type ByteTokenizer "
        "--num-workers 0 --eval-iters 0 --ckpt-format torch_dist --no-save-optim "
        f"--log-interval {max(1, save_interval // 2)} --save-interval {save_interval}"
    ).split()
    return flags + ["--train-data-path", data_prefix]


def prepare_data(p: Preset, outdir: str, py: str) -> Dict:
    """Split the KJV verses, tokenize the budget with ``megadlms.data.preprocess``; returns
    the token counts and the evaluation inputs."""
    from megadlms.data import kjv_jsonl_path

    ddir = os.path.join(outdir, "data")
    os.makedirs(ddir, exist_ok=True)
    split = data.split_verses(
        data.read_verses(kjv_jsonl_path()),
        unique_tokens=p.unique_tokens,
        heldout_tokens=p.heldout_rows * (p.seq_length + 1) + p.seq_length,
        cloze_questions=2 * p.cloze_questions,  # spares: build_cloze skips unusable verses
        min_cloze_bytes=12 + p.answer_len + 8,
        seed=p.seed,
    )
    changed = [
        data.write_jsonl(getattr(split, n), os.path.join(ddir, f"{n}.jsonl"))
        for n in ("train", "heldout", "cloze")
    ]
    prefix = os.path.join(ddir, "kjv_budget")
    if changed[0] or not os.path.isfile(prefix + "_text_document.idx"):
        cmd = [py, "-m", "megadlms.data.preprocess", "--input", os.path.join(ddir, "train.jsonl")]
        cmd += ["--json-keys", "text", "--output-prefix", prefix, "--tokenizer-type", "ByteTokenizer"]
        subprocess.run(cmd + ["--append-eod", "--workers", "1"], check=True, capture_output=True, timeout=600)
    max_prompt = p.seq_length - p.answer_len - 1
    return {
        "prefix": prefix + "_text_document",
        "train_tokens": split.train_tokens,
        "train_verses": len(split.train),
        "heldout_rows": data.token_rows(split.heldout, p.seq_length, p.heldout_rows),
        "train_rows": data.token_rows(split.train, p.seq_length, p.heldout_rows),
        "cloze": data.build_cloze(
            split.cloze, num_questions=p.cloze_questions, num_choices=p.cloze_choices,
            answer_len=p.answer_len, min_prompt=12, max_prompt=min(max_prompt, 48), seed=p.seed,
        ),
    }  # fmt: skip


TORCHRUN_ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
)  # fmt: skip


def run_training(runs: Dict[str, List[str]], outdir: str, py: str, jobs: int, threads: int) -> None:
    """Both trainings through ``python -m megadlms.pretrain``, ``jobs`` at a time."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    # Each training is a world of one: torchrun variables inherited from the caller (a shell
    # inside a launch, or a process that ran a trainer in-process) would make both trainings
    # rendezvous on the same MASTER_PORT (EADDRINUSE) or join a world that is not theirs.
    for name in TORCHRUN_ENV:
        env.pop(name, None)
    pending = list(runs.items())
    live: List[tuple] = []  # (model, its process, its log file)
    while pending or live:
        while pending and len(live) < jobs:
            model, flags = pending.pop(0)
            log = open(os.path.join(outdir, "runs", model, "train.log"), "w")
            print(f"   training {model}: log {log.name}", flush=True)
            proc = subprocess.Popen(
                [py, "-m", "megadlms.pretrain", *flags], stdout=log, stderr=subprocess.STDOUT, env=env
            )
            live.append((model, proc, log))
        time.sleep(1.0)
        for entry in [e for e in live if e[1].poll() is not None]:
            model, proc, log = entry
            log.close()
            live.remove(entry)
            if proc.returncode != 0:
                for _, other, _ in live:
                    other.kill()
                with open(log.name) as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(
                    f"training {model} failed (exit {proc.returncode}); end of {log.name}:\n{tail}"
                )


def _shared(flags: List[str]) -> List[str]:
    """The flags without the mode flags and the per-run paths (--save, --data-cache-path)."""
    out, skip = [], False
    for x in flags:
        if skip or x in ("--save", "--data-cache-path"):
            skip = not skip
            continue
        if x not in MODES["ar"] + MODES["dlm"]:
            out.append(x)
    return out


def check_matched(runs: Dict[str, List[str]], outdir: str) -> Dict[str, bool]:
    """What the two runs share, read back from their flags, checkpoints and data caches."""
    ar, dlm = (_shared(runs[m]) for m in ("ar", "dlm"))
    last = checkpoints(outdir)[-1]
    commons = {}
    for m in ("ar", "dlm"):
        with open(os.path.join(outdir, "runs", m, "save", f"iter_{last:07d}", "common.json")) as f:
            commons[m] = json.load(f)
    idx = {
        m: sorted(glob.glob(os.path.join(outdir, "runs", m, "cache", "*index.npy"))) for m in ("ar", "dlm")
    }
    same_order = len(idx["ar"]) == len(idx["dlm"]) > 0 and all(
        filecmp.cmp(a, b, shallow=False) for a, b in zip(idx["ar"], idx["dlm"])
    )
    keys = ("iteration", "consumed_samples")
    return {
        "flags identical except --model-running-mode / --attention-mask-type": ar == dlm
        and runs["ar"] != runs["dlm"],
        "same data order (byte-identical dataset index caches)": same_order,
        "same iterations and consumed samples (tokens per step)": all(
            commons["ar"][k] == commons["dlm"][k] for k in keys
        ),
        "same LR schedule and weight decay (checkpoint records)": commons["ar"]["scheduler"]
        == commons["dlm"]["scheduler"],
        "same model shape (checkpoint records, attention aside)": {
            k: v for k, v in commons["ar"]["model_config"].items() if k != "attention"
        }
        == {k: v for k, v in commons["dlm"]["model_config"].items() if k != "attention"},
    }


def checkpoints(outdir: str) -> List[int]:
    """Iterations saved by both runs (complete checkpoints only: at most each run's
    latest_checkpointed_iteration.txt, so a run still training can be evaluated), ascending."""
    common: Optional[set] = None
    for m in MODES:
        save = os.path.join(outdir, "runs", m, "save")
        latest = os.path.join(save, "latest_checkpointed_iteration.txt")
        if not os.path.isfile(latest):
            return []
        with open(latest) as f:
            last = int(f.read().strip())
        its = {int(d[len("iter_") :]) for d in os.listdir(save) if d.startswith("iter_")}
        its = {i for i in its if i <= last}
        common = its if common is None else common & its
    return sorted(common or ())


def evaluate(outdir: str, d: Dict, p: Preset, jobs: int, threads: int) -> List[Dict]:
    """Score every checkpoint of both runs (``jobs`` worker processes); csv rows."""
    from .crossover_eval import checkpoint_task

    kw = dict(
        heldout_rows=d["heldout_rows"], train_rows=d["train_rows"], cloze=d["cloze"],
        nelbo_mc=p.nelbo_mc, cloze_mc=p.cloze_mc, seed=p.seed,
    )  # fmt: skip
    tokens_per_step = p.global_batch_size * p.seq_length
    rows = []
    with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        futs = {}
        # by iteration, so the cached scores of an interrupted evaluation come in (ar, dlm) pairs
        for it in checkpoints(outdir):
            for m in ("dlm", "ar"):
                ckpt = os.path.join(outdir, "runs", m, "save", f"iter_{it:07d}")
                cache = os.path.join(outdir, "runs", m, "eval", f"iter_{it:07d}.json")
                futs[m, it] = pool.submit(checkpoint_task, ckpt, threads, cache, **kw)
        for (m, it), fut in sorted(futs.items()):
            r, tokens = fut.result(), it * tokens_per_step
            for metric in report.METRICS:
                rows.append(
                    {"model": m, "epoch": round(tokens / d["train_tokens"], 3), "iteration": it,
                     "tokens": tokens, "metric": metric, "value": r[metric]}
                )  # fmt: skip
    return rows


def setting_table(p: Preset, d: Dict, iters: int, preset: str, evaluated: Sequence[int]) -> Dict:
    from megadlms.common.enums import PositionEmbeddingType
    from megadlms.models import GPTModel, TransformerConfig

    cfg = TransformerConfig(
        num_layers=p.num_layers, hidden_size=p.hidden_size, num_attention_heads=p.num_attention_heads,
        vocab_size=384, seq_length=p.seq_length, position_embedding_type=PositionEmbeddingType.ROPE,
        swiglu=True, normalization="RMSNorm", add_bias_linear=False,
    )  # fmt: skip
    params = sum(x.numel() for x in GPTModel(cfg).parameters())
    return {
        "preset": preset,
        "model": f"{p.num_layers} layers, hidden {p.hidden_size}, {params / 1e6:.2f}M parameters (both)",
        "unique training tokens": f"{d['train_tokens']} ({d['train_verses']} KJV verses, byte-level)",
        "epochs": f"{iters * p.global_batch_size * p.seq_length / d['train_tokens']:.1f} ({iters} steps)",
        "evaluated": f"{len(evaluated)} checkpoints per model, the last at step {evaluated[-1]}"
        + ("" if evaluated[-1] == iters else " (training not finished: a partial run)"),
        "tokens per step": f"{p.global_batch_size * p.seq_length} ({p.global_batch_size} x {p.seq_length})",
        "held-out loss rows": f"{d['heldout_rows'].shape[0]} x {p.seq_length} tokens, "
        f"DLM {p.nelbo_mc} MC copies",
        "cloze": f"{len(d['cloze'])} questions, {p.cloze_choices} choices of {p.answer_len} bytes, "
        f"DLM {p.cloze_mc} MC draws per choice",
        "cloze chance": f"{1 / p.cloze_choices:.4f}",
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="crossover", description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", help="output directory (created; runs/ holds the checkpoints and logs)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--quick", action="store_true", help="= --preset quick")
    ap.add_argument("--epochs", type=int, default=None, help="override the preset's epochs")
    ap.add_argument("--jobs", type=int, default=2, help="trainings / evaluations run at once (default 2)")
    ap.add_argument("--skip-train", action="store_true", help="re-evaluate the checkpoints already in OUTDIR")
    args = ap.parse_args(argv)
    name = "quick" if args.quick else args.preset
    p = PRESETS[name] if args.epochs is None else dataclasses.replace(PRESETS[name], epochs=args.epochs)
    py, out = sys.executable, os.path.abspath(args.outdir)
    threads = max(1, (os.cpu_count() or 2) // args.jobs)
    t0 = time.time()
    print(f"== crossover ({name}): data -> {out}/data", flush=True)
    d = prepare_data(p, out, py)
    steps_per_epoch = d["train_tokens"] / (p.global_batch_size * p.seq_length)
    save_interval = max(1, round(p.eval_every * steps_per_epoch))
    iters = save_interval * max(1, round(p.epochs / p.eval_every))
    runs = {}
    for m, mode in MODES.items():
        rdir = os.path.join(out, "runs", m)
        os.makedirs(rdir, exist_ok=True)
        cache, save = (
            ["--data-cache-path", os.path.join(rdir, "cache")],
            ["--save", os.path.join(rdir, "save")],
        )
        runs[m] = train_flags(p, data_prefix=d["prefix"], train_iters=iters, save_interval=save_interval)
        runs[m] += mode + cache + save
        with open(os.path.join(rdir, "command.json"), "w") as f:
            json.dump([py, "-m", "megadlms.pretrain", *runs[m]], f, indent=1)
    if not args.skip_train:
        print(f"== train AR and DLM: {iters} steps each, checkpoint every {save_interval}", flush=True)
        run_training(runs, out, py, args.jobs, threads)
    if not checkpoints(out):
        raise RuntimeError(f"{out}/runs: no checkpoint saved by both runs yet; nothing to evaluate")
    checks = check_matched(runs, out)
    print(f"== evaluate the checkpoints ({time.time() - t0:.0f} s so far)", flush=True)
    rows = evaluate(out, d, p, args.jobs, threads)
    setting = setting_table(p, d, iters, name, checkpoints(out))
    report.write_csv(rows, os.path.join(out, "crossover.csv"))
    title = f"KJV, {setting['unique training tokens'].split(' (')[0]} unique tokens, {setting['model']}"
    report.plot(rows, os.path.join(out, "crossover.png"), chance=1 / p.cloze_choices, title=title)
    text = report.summary(rows, setting, checks)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text + f"\nWall time: {time.time() - t0:.0f} s.\n")
    print(text, flush=True)
    print(f"wrote {out}/crossover.csv, crossover.png, summary.md ({time.time() - t0:.0f} s)")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
