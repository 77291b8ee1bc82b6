"""Fast generation measured as Fast-dLLM's table does: tokens/s, forward passes (NFE) and answer
quality for the plain sampler, parallel decoding (threshold), the prefix and dual KV caches, and
their combinations, on one checkpoint, in one run (interleaved rounds, medians).

    # held-out exact match of a chat task (examples/sft.sh's fine-tuned model and its data dir):
    python benchmarks/bench_generation.py --load demo_sft/sft --heldout demo_sft \
        --gen-length 8 --block-length 4
    # a text prompt repeated --batch times (quality: tokens equal to the plain sampler's answer):
    python benchmarks/bench_generation.py --load demo/checkpoints --prompt "And God said" --gen-length 48

Prints a markdown table; the quality column says where the cache or the threshold changes answers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Dict, List, Optional, Tuple

import torch

from megadlms.diffusion import generate
from megadlms.generate import load_for_inference


def _modes(threshold: float) -> List[Tuple[str, Optional[float], Optional[str]]]:
    return [
        ("plain (one step per token)", None, None),
        (f"threshold {threshold}", threshold, None),
        ("prefix cache", None, "prefix"),
        ("dual cache", None, "dual"),
        (f"threshold {threshold} + prefix cache", threshold, "prefix"),
        (f"threshold {threshold} + dual cache", threshold, "dual"),
    ]


def _heldout(path: str) -> Tuple[torch.Tensor, List[List[str]], object]:
    """(prompt ids [n, P], the reference answers' words, the chat tokenizer) of a held-out chat set."""
    from megadlms.data.chat import chat_prompt_ids, load_chat_tokenizer

    chat = load_chat_tokenizer(os.path.join(path, "tokenizer"))
    with open(os.path.join(path, "heldout.jsonl")) as f:
        rows = [json.loads(line)["messages"] for line in f]
    prompts = torch.tensor([chat_prompt_ids(chat, m[:1]) for m in rows])  # equal lengths: one batch
    return prompts, [r[1]["content"].split() for r in rows], chat


def _exact_match(out: torch.Tensor, answers: List[List[str]], chat) -> float:
    eot = chat.convert_tokens_to_ids("<|eot_id|>")
    right = 0
    for ids, words in zip(out.tolist(), answers):
        ids = ids[: ids.index(eot)] if eot in ids else ids
        right += chat.decode(ids).split() == words
    return 100.0 * right / len(answers)


def run(args) -> List[Dict]:
    model, tokenizer, _ = load_for_inference(args.load, torch.device("cpu"))
    if args.heldout:
        prompts, answers, chat = _heldout(args.heldout)
    else:
        prompts = torch.tensor([tokenizer.tokenize(args.prompt)] * args.batch)
    P = prompts.shape[1]
    settings = dict(
        mask_token_id=tokenizer.mask, gen_length=args.gen_length, steps=args.steps or args.gen_length,
        block_length=args.block_length or args.gen_length,
    )  # fmt: skip
    modes = _modes(args.threshold)
    times: Dict[str, List[float]] = {name: [] for name, _, _ in modes}
    results: Dict[str, Tuple[torch.Tensor, int]] = {}
    for _ in range(args.reps):  # interleaved rounds: machine noise spreads over every mode alike
        for name, threshold, cache in modes:
            stats: dict = {}
            start = time.perf_counter()
            out = generate(model, prompts, threshold=threshold, cache=cache, stats=stats, **settings)
            times[name].append(time.perf_counter() - start)
            results[name] = (out[:, P:], stats["nfe"])
    plain = results[modes[0][0]][0]
    rows = []
    for name, _, _ in modes:
        out, nfe = results[name]
        seconds = statistics.median(times[name])
        if args.heldout:
            quality = f"{_exact_match(out, answers, chat):.1f}% exact match"
        else:
            quality = f"{100.0 * (out == plain).float().mean().item():.1f}% tokens as plain"
        rows.append(
            {
                "mode": name,
                "tokens_per_s": out.numel() / seconds,
                "nfe": nfe,
                "seconds": seconds,
                "quality": quality,
            }
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--load", required=True, help="checkpoint directory (a --save directory)")
    p.add_argument(
        "--heldout", default=None, help="a chat task dir: heldout.jsonl + tokenizer/ (exact match)"
    )
    p.add_argument("--prompt", default="And God said", help="text prompt (without --heldout)")
    p.add_argument("--batch", type=int, default=8, help="copies of --prompt in the batch")
    p.add_argument("--gen-length", type=int, default=8)
    p.add_argument("--steps", type=int, default=None, help="default: --gen-length (one token a step)")
    p.add_argument("--block-length", type=int, default=None, help="default: --gen-length (one block)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--reps", type=int, default=5, help="interleaved rounds (the median is reported)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = run(args)
    base = rows[0]["tokens_per_s"]
    block = args.block_length or args.gen_length
    cpu = platform.processor() or platform.machine()
    print(f"# {args.load}: {cpu}, {torch.get_num_threads()} threads, gen {args.gen_length}, block {block}, "
          f"median of {args.reps}")  # fmt: skip
    print("| decoding | tokens/s | speed-up | NFE | quality |\n|---|---|---|---|---|")
    for r in rows:
        speed = r["tokens_per_s"] / base
        print(f"| {r['mode']} | {r['tokens_per_s']:.0f} | {speed:.2f}x | {r['nfe']} | {r['quality']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
