"""A synthetic instruction task with checkable answers, for examples/sft.sh.

    python examples/sft_task.py data OUT            # tokenizer + train / held-out conversations
    python examples/sft_task.py eval CKPT OUT       # exact match on the held-out prompts

The task: "reverse" a word of 4 letters from an 8-letter alphabet ("reverse c a h b" ->
"b h a c"). The 4,096 words are split once: held-out prompts never occur in training. The
tokenizer is a word-level one (a letter is a token) with LLaDA-8B-Instruct's chat template
(LLaMA-3 headers), written here: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
from typing import List

LETTERS = "abcdefgh"
WORD = 4
HELD_OUT = 256
SPECIALS = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|mdm_mask|>",
]
TEMPLATE = (
    "{% for message in messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|> '"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|> ' }}{% endif %}"
)


def write_tokenizer(directory: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = ["[UNK]", "system", "user", "assistant", "reverse", *LETTERS]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.add_special_tokens(SPECIALS)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|startoftext|>",
        "eos_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)


def _conversation(word: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "reverse " + " ".join(word)},
            {"role": "assistant", "content": " ".join(reversed(word))},
        ]
    }


def make_data(out: str) -> None:
    """OUT/tokenizer/, OUT/train.jsonl (every word but the held-out ones), OUT/heldout.jsonl."""
    words = ["".join(w) for w in itertools.product(LETTERS, repeat=WORD)]
    random.Random(0).shuffle(words)
    held, train = words[:HELD_OUT], words[HELD_OUT:]
    write_tokenizer(os.path.join(out, "tokenizer"))
    for name, split in (("train", train), ("heldout", held)):
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            for word in split:
                f.write(json.dumps(_conversation(word)) + "\n")
    print(f"{out}: {len(train)} training conversations, {len(held)} held-out ones (disjoint words)")


def exact_match(ckpt: str, out: str, gen_length: int = 8, threshold=None, stats=None) -> float:
    """Held-out exact match of the checkpoint's greedy low-confidence samples (the answer cut at
    the end-of-turn token), one batch; ``threshold``: Fast-dLLM's parallel decoding (``stats``
    receives the forward passes, "nfe")."""
    import torch

    from megadlms.data.chat import chat_prompt_ids, load_chat_tokenizer
    from megadlms.diffusion import generate
    from megadlms.generate import load_for_inference

    model, tokenizer, _ = load_for_inference(ckpt, torch.device("cpu"))
    chat = load_chat_tokenizer(os.path.join(out, "tokenizer"))
    with open(os.path.join(out, "heldout.jsonl")) as f:
        rows = [json.loads(line)["messages"] for line in f]
    prompts = torch.tensor([chat_prompt_ids(chat, m[:1]) for m in rows])  # equal lengths: one batch
    eot = chat.convert_tokens_to_ids("<|eot_id|>")
    with torch.no_grad():
        x = generate(
            model, prompts, mask_token_id=tokenizer.mask, gen_length=gen_length, steps=gen_length,
            block_length=gen_length, temperature=0.0, remasking="low_confidence", threshold=threshold,
            stats=stats,
        )  # fmt: skip
    right = 0
    for row, ids in zip(rows, x[:, prompts.shape[1] :].tolist()):
        answer: List[int] = ids[: ids.index(eot)] if eot in ids else ids
        right += chat.decode(answer).split() == row[1]["content"].split()
    return right / len(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("data")
    d.add_argument("out")
    e = sub.add_parser("eval")
    e.add_argument("ckpt")
    e.add_argument("out")
    e.add_argument("--threshold", type=float, default=None, help="parallel decoding (Fast-dLLM)")
    args = p.parse_args(argv)
    if args.cmd == "data":
        make_data(args.out)
    elif args.threshold is None:
        print(f"{100 * exact_match(args.ckpt, args.out):.1f}")
    else:
        stats: dict = {}
        score = exact_match(args.ckpt, args.out, threshold=args.threshold, stats=stats)
        print(f"{100 * score:.1f}% in {stats['nfe']} forward passes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
