"""A tiny chat tokenizer directory for SFT tests (no download): a WordLevel tokenizer.json
with special tokens and a tokenizer_config.json carrying a jinja chat template in the
style of LLaDA-8B-Instruct's (LLaMA-3 headers) or Qwen's (ChatML)."""

from __future__ import annotations

import json
import os
from typing import Dict

# Content words the tests write; anything else becomes [UNK].
WORDS = (
    "[UNK] system user assistant you are a helpful bot what is one two three four five six seven "
    "eight nine ten plus minus equals hello hi there how do please answer the question yes no "
    "reverse word copy say again why because good bad . ? ,"
).split()

LLADA_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_STYLES: Dict[str, Dict] = {
    "llada": {
        "specials": [
            "<|startoftext|>",
            "<|endoftext|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|mdm_mask|>",
        ],
        "config": {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>"},
        "template": LLADA_TEMPLATE,
        "end_of_turn": "<|eot_id|>",
    },
    "qwen": {
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mdm_mask|>"],
        "config": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        "template": QWEN_TEMPLATE,
        "end_of_turn": "<|im_end|>",
    },
}


def end_of_turn_token(style: str = "llada") -> str:
    """The end-of-turn token of ``style``'s template."""
    return _STYLES[style]["end_of_turn"]


def make_chat_tokenizer(directory, style: str = "llada", template: bool = True) -> str:
    """Write tokenizer.json + tokenizer_config.json into ``directory``; returns its path.

    ``style``: "llada" or "qwen"; ``template=False`` leaves the chat template out.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spec = _STYLES[style]
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(cleanup=False)
    tok.add_special_tokens(spec["specials"])
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, **spec["config"]}
    if template:
        config["chat_template"] = spec["template"]
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return directory
